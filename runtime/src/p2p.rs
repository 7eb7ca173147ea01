//! `runtime p2p-bench`: point-to-point throughput between two ranks through the same c10d path
//! activations take (a contiguous float tensor, asynchronous send, wait), for bench/.

use std::io::Write;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::comm::{ProcessGroup, Store};
use crate::config::P2pConfig;

/// Rank 0 sends `rounds` tensors of `bytes` to rank 1; rank 1 prints one JSON line with the rate.
pub fn run(config: &P2pConfig, out: &mut impl Write) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(60);
    let store = Store::connect(
        &config.master_addr,
        config.master_port,
        2,
        config.rank == 0,
        timeout,
    )?;
    let group = ProcessGroup::gloo(&store, config.rank, 2, timeout)?;
    let elements = (config.bytes / 4) as i64;
    let mut tensor = Tensor::ones([elements], (Kind::Float, Device::Cpu));
    // One round untimed, to set up the connection's buffers.
    let mut exchange = |round: usize| -> anyhow::Result<()> {
        let tag = round as u32;
        if config.rank == 0 {
            group.send(&tensor, 1, tag)?.wait()?;
        } else {
            group.recv(&mut tensor, 0, tag)?.wait()?;
        }
        Ok(())
    };
    exchange(0)?;
    let started = Instant::now();
    for round in 1..=config.rounds {
        exchange(round)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    group.barrier()?;
    if config.rank == 1 {
        let moved = (config.bytes * config.rounds) as f64;
        let line = serde_json::json!({
            "bytes": config.bytes,
            "rounds": config.rounds,
            "seconds": seconds,
            "gb_per_s": moved / seconds / 1e9,
        });
        writeln!(out, "{line}")?;
    }
    Ok(())
}
