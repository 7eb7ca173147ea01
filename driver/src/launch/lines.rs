//! Lines of output: read from a child's pipe ([`for_each_line`]), or split from byte chunks that
//! do not arrive line by line (Docker's log and attach streams, [`LineSplitter`]).

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// Calls `each` with every line of `stream` (without its line ending) until the stream ends.
/// Bytes, not `lines()`: a program printing invalid UTF-8 must not silence the rest of its output.
pub async fn for_each_line(stream: impl AsyncRead + Unpin, mut each: impl FnMut(String)) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    while let Ok(n) = reader.read_until(b'\n', &mut buf).await {
        if n == 0 {
            break;
        }
        let line = String::from_utf8_lossy(&buf)
            .trim_end_matches(['\n', '\r'])
            .to_string();
        buf.clear();
        each(line);
    }
}

/// Buffers a partial line between chunks.
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Feeds a chunk and returns the lines it completed, without their newlines.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        for &b in chunk {
            if b == b'\n' {
                let raw = std::mem::take(&mut self.partial);
                lines.push(clean(&raw));
            } else {
                self.partial.push(b);
            }
        }
        lines
    }

    /// The unterminated last line, if any.
    pub fn finish(&mut self) -> Option<String> {
        (!self.partial.is_empty()).then(|| clean(&std::mem::take(&mut self.partial)))
    }
}

fn clean(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    text.strip_suffix('\r').unwrap_or(&text).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks_are_joined() {
        let mut s = LineSplitter::default();
        assert_eq!(s.push(b"ab"), Vec::<String>::new());
        assert_eq!(s.push(b"c\r\nde\nf"), vec!["abc".to_string(), "de".to_string()]);
        assert_eq!(s.finish(), Some("f".to_string()));
        assert_eq!(s.finish(), None);
    }
}
