//! Writing the metrics contract: one JSON event per line on stdout, flushed at once so the driver
//! sees progress live, plus the measurements those events carry (throughput statistics, peak
//! memory).

use std::io::{self, Write};

use stagehand_contract::Event;

/// Writes events, one line each, to stdout (or any writer in tests).
pub struct Emitter<W: Write> {
    out: W,
    /// Whether the reader went away and the run goes on to its checkpoint without it.
    gone: bool,
}

impl<W: Write> Emitter<W> {
    pub fn new(out: W) -> Self {
        Emitter { out, gone: false }
    }

    /// Writes `event`'s line. A reader gone (a broken pipe) in a run that checkpoints stops the
    /// run at the end of the iteration it is in, after its checkpoint, as SIGTERM does
    /// ([`crate::signals::output_gone`]); lines after that go nowhere.
    pub fn emit(&mut self, event: &Event) -> io::Result<()> {
        if self.gone {
            return Ok(());
        }
        let written = writeln!(self.out, "{}", event.to_line()).and_then(|()| self.out.flush());
        match written {
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe && crate::signals::output_gone() => {
                self.gone = true;
                Ok(())
            }
            other => other,
        }
    }
}

/// Mean and standard deviation of per-iteration throughput after warm-up, over the iterations
/// PyTorch's profiler did not slow when there are any (`--profiler-trace`), else over all.
#[derive(Debug, Default)]
pub struct Throughput {
    values: Vec<f64>,
    profiled: Vec<f64>,
}

impl Throughput {
    /// One iteration's rate; `profiled` when the profiler slowed it.
    pub fn push(&mut self, samples_per_sec: f64, profiled: bool) {
        match profiled {
            false => self.values.push(samples_per_sec),
            true => self.profiled.push(samples_per_sec),
        }
    }

    fn measured(&self) -> &[f64] {
        match self.values.is_empty() {
            false => &self.values,
            true => &self.profiled,
        }
    }

    pub fn mean(&self) -> f64 {
        stagehand_contract::metrics::mean_and_std(self.measured()).0
    }

    /// Whether any iteration was measured (every one may have been warm-up).
    pub fn measured_any(&self) -> bool {
        !self.measured().is_empty()
    }

    /// Sample standard deviation (0 with fewer than two values).
    pub fn std(&self) -> f64 {
        stagehand_contract::metrics::mean_and_std(self.measured()).1
    }
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A rank's memory figures, as the metrics lines carry them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// The device's peak: the allocator's peak allocated bytes on CUDA, the host's on the CPU.
    pub peak: Option<u64>,
    pub host_peak_rss: Option<u64>,
    pub gpu_peak_allocated: Option<u64>,
    pub gpu_peak_reserved: Option<u64>,
}

impl Memory {
    /// The figures now for a rank computing on `device`.
    pub fn read(device: tch::Device) -> Memory {
        let host_peak_rss = peak_rss_bytes();
        let gpu = match device {
            tch::Device::Cuda(index) => crate::cuda::cuda()
                .ok()
                .and_then(|cuda| cuda.memory_peaks(index).ok()),
            _ => None,
        };
        Memory {
            peak: match device {
                tch::Device::Cuda(_) => gpu.map(|g| g.allocated),
                _ => host_peak_rss,
            },
            host_peak_rss,
            gpu_peak_allocated: gpu.map(|g| g.allocated),
            gpu_peak_reserved: gpu.map(|g| g.reserved),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_memory_is_the_host_peak_and_no_gpu_figures() {
        let memory = Memory::read(tch::Device::Cpu);
        assert!(memory.peak.unwrap() > 1 << 20);
        assert_eq!(memory.peak, memory.host_peak_rss);
        assert_eq!(
            (memory.gpu_peak_allocated, memory.gpu_peak_reserved),
            (None, None)
        );
    }

    #[test]
    fn throughput_statistics() {
        let mut t = Throughput::default();
        assert_eq!((t.mean(), t.std()), (0.0, 0.0));
        // Only profiled iterations so far: they are all there is to measure.
        t.push(3.0, true);
        t.push(5.0, true);
        assert_eq!((t.mean(), t.std()), (4.0, 2f64.sqrt()));
        for v in [10.0, 12.0, 14.0] {
            t.push(v, false);
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
            final_accuracy: Some(0.25),
            final_accuracy_top5: Some(0.75),
            peak_mem_bytes: None,
            host_peak_rss_bytes: None,
            gpu_peak_allocated_bytes: None,
            gpu_peak_reserved_bytes: None,
            skipped_steps: None,
            validation: None,
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
