//! `.dockerignore` as Docker reads it: one pattern a line, `#` comments, `!` re-includes, paths
//! relative to the context's root (a leading `/` means the same), `*` and `?` within one path
//! segment, `**` across any number of segments, `[...]` classes and `\` escapes. A file is left
//! out when the last pattern matching it, or one of its parent folders, excludes it.

/// The patterns of one `.dockerignore`.
#[derive(Debug, Clone, Default)]
pub struct Ignore {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone)]
struct Pattern {
    segments: Vec<String>,
    exclude: bool,
}

impl Ignore {
    /// Parses the text of a `.dockerignore`.
    pub fn parse(text: &str) -> Ignore {
        let patterns = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|line| {
                let (exclude, body) = match line.strip_prefix('!') {
                    Some(rest) => (false, rest.trim()),
                    None => (true, line),
                };
                let segments: Vec<String> = body
                    .split('/')
                    .filter(|s| !s.is_empty() && *s != ".")
                    .map(str::to_string)
                    .collect();
                (!segments.is_empty()).then_some(Pattern { segments, exclude })
            })
            .collect();
        Ignore { patterns }
    }

    /// Whether `path` (relative, `/`-separated) is left out of the context.
    pub fn excludes(&self, path: &str) -> bool {
        let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let mut excluded = false;
        for p in &self.patterns {
            // The pattern matches the path itself or one of its parent folders.
            let hit = (1..=parts.len()).any(|n| match_segments(&p.segments, &parts[..n]));
            if hit {
                excluded = p.exclude;
            }
        }
        excluded
    }
}

fn match_segments(pattern: &[String], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| match_segments(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((head, tail)) => {
                let p: Vec<char> = first.chars().collect();
                let s: Vec<char> = head.chars().collect();
                match_one(&p, &s) && match_segments(rest, tail)
            }
            None => false,
        },
    }
}

/// Go's `filepath.Match` within one segment.
fn match_one(p: &[char], s: &[char]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some('*') => (0..=s.len()).any(|k| match_one(&p[1..], &s[k..])),
        Some('?') => !s.is_empty() && match_one(&p[1..], &s[1..]),
        Some('[') => {
            let Some((c, rest_s)) = s.split_first() else {
                return false;
            };
            match class(&p[1..], *c) {
                Some((matched, after)) => matched && match_one(after, rest_s),
                // An unterminated class matches a literal `[`.
                None => *c == '[' && match_one(&p[1..], rest_s),
            }
        }
        Some('\\') if p.len() > 1 => s.first() == Some(&p[1]) && match_one(&p[2..], &s[1..]),
        Some(lit) => s.first() == Some(lit) && match_one(&p[1..], &s[1..]),
    }
}

/// Matches `c` against a class body (after `[`); returns whether it matched and the pattern after
/// the closing `]`.
fn class(p: &[char], c: char) -> Option<(bool, &[char])> {
    let (negate, mut i) = match p.first() {
        Some('^') | Some('!') => (true, 1),
        _ => (false, 0),
    };
    let mut matched = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == ']' && !first {
            return Some((matched != negate, &p[i + 1..]));
        }
        first = false;
        let lo = if p[i] == '\\' && i + 1 < p.len() {
            i += 1;
            p[i]
        } else {
            p[i]
        };
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            let hi = p[i + 2];
            matched |= lo <= c && c <= hi;
            i += 3;
        } else {
            matched |= lo == c;
            i += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_and_their_contents_are_left_out() {
        let ig = Ignore::parse("target\n# comment\n/docs/*.md\n");
        assert!(ig.excludes("target"));
        assert!(ig.excludes("target/release/runtime"));
        assert!(!ig.excludes("runtime/target.rs"));
        assert!(ig.excludes("docs/a.md"));
        assert!(!ig.excludes("docs/sub/a.md"));
        assert!(!ig.excludes("README.md"));
    }

    #[test]
    fn double_star_spans_folders_and_the_last_match_wins() {
        let ig = Ignore::parse("**/*.log\ndriver/**\n!driver/Cargo.toml\n");
        assert!(ig.excludes("a.log"));
        assert!(ig.excludes("x/y/z.log"));
        assert!(ig.excludes("driver/src/main.rs"));
        assert!(!ig.excludes("driver/Cargo.toml"));
        assert!(!ig.excludes("runtime/src/main.rs"));
    }

    #[test]
    fn single_star_stays_within_a_segment() {
        let ig = Ignore::parse("*/tests\nb?t\n[abc]x\n[!a]y\n");
        assert!(ig.excludes("driver/tests/a.rs"));
        assert!(!ig.excludes("tests/a.rs"));
        assert!(!ig.excludes("a/b/tests"));
        assert!(ig.excludes("bat") && ig.excludes("bot"));
        assert!(!ig.excludes("boat"));
        assert!(ig.excludes("bx") && !ig.excludes("dx"));
        assert!(ig.excludes("by") && !ig.excludes("ay"));
    }
}
