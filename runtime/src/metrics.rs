//! Writing the metrics contract: one JSON event per line on stdout, flushed at once so the driver
//! sees progress live, plus the measurements those events carry (throughput statistics, peak
//! memory).

use std::io::{self, Write};

use stagehand_contract::Event;

/// Writes events, one line each, to stdout (or any writer in tests).
pub struct Emitter<W: Write> {
    out: W,
}

impl<W: Write> Emitter<W> {
    pub fn new(out: W) -> Self {
        Emitter { out }
    }

    pub fn emit(&mut self, event: &Event) -> io::Result<()> {
        writeln!(self.out, "{}", event.to_line())?;
        self.out.flush()
    }
}

/// Running mean and standard deviation of per-iteration throughput after warm-up.
#[derive(Debug, Default)]
pub struct Throughput {
    values: Vec<f64>,
}

impl Throughput {
    pub fn push(&mut self, samples_per_sec: f64) {
        self.values.push(samples_per_sec);
    }

    pub fn mean(&self) -> f64 {
        if self.values.is_empty() {
            return 0.0;
        }
        self.values.iter().sum::<f64>() / self.values.len() as f64
    }

    /// Sample standard deviation (0 with fewer than two values).
    pub fn std(&self) -> f64 {
        let n = self.values.len();
        if n < 2 {
            return 0.0;
        }
        let mean = self.mean();
        (self.values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    }
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_statistics() {
        let mut t = Throughput::default();
        assert_eq!((t.mean(), t.std()), (0.0, 0.0));
        for v in [10.0, 12.0, 14.0] {
            t.push(v);
        }
        assert_eq!(t.mean(), 12.0);
        assert_eq!(t.std(), 2.0);
    }

    #[test]
    fn events_are_flushed_one_per_line() {
        let mut buf = Vec::new();
        let summary = stagehand_contract::Summary {
            rank: 0,
            stage: 0,
            iterations: 2,
            warmup_iterations: 1,
            samples_per_sec_mean: 5.0,
            samples_per_sec_std: 0.0,
            time_s: 1.0,
            compute_s: 1.0,
            comm_wait_s: 0.0,
            idle_s: 0.0,
            final_loss: Some(0.5),
            peak_mem_bytes: None,
        };
        Emitter::new(&mut buf)
            .emit(&Event::Summary(summary.clone()))
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert_eq!(text.lines().count(), 1);
        assert_eq!(Event::parse_line(&text), Some(Event::Summary(summary)));
    }

    #[test]
    fn peak_memory_is_read_on_linux() {
        assert!(peak_rss_bytes().unwrap() > 1 << 20);
    }
}
