//! Bundle-style reduce of a replicated stage's gradients (the stage config's `bundles`): the
//! stage's ranks in each bundle send their gradients to the bundle's master (its lowest rank of
//! the stage), which sums them in rank order, all-reduces the sum with the other bundles' masters,
//! and sends the result back. Only the masters talk across bundles, so the traffic between
//! bundles is one all-reduce among as many ranks as there are bundles; inside a bundle, each
//! member sends its gradients once and gets the sum once.

use std::time::Instant;

use tch::{Device, Tensor};

use super::reduce::{ring_bytes, Flat, ReduceStats};
use crate::comm::{ProcessGroup, Work};

/// Tags of the member-to-master and master-to-member messages on the bundle's own group.
const UP: u32 = 1;
const DOWN: u32 = 2;

/// This rank's groups for its stage's bundle reduce.
pub struct Bundle {
    /// The stage's ranks in this rank's bundle (group rank 0 is the master); none when alone.
    pub local: Option<ProcessGroup>,
    /// The masters of the stage's bundles, on masters only; none with one bundle.
    pub masters: Option<ProcessGroup>,
}

impl Bundle {
    fn is_master(&self) -> bool {
        self.local.as_ref().is_none_or(|g| g.rank() == 0)
    }

    /// Reduces `params`' gradients (each multiplied by `scale` first, if given) across every
    /// replica of the stage, in place. Every parameter must have a gradient.
    pub fn reduce(
        &self,
        params: &[Tensor],
        scale: Option<f64>,
        device: Device,
    ) -> Result<ReduceStats, String> {
        let started = Instant::now();
        let everything: Vec<usize> = (0..params.len()).collect();
        // The gradients move into one flat buffer (views of it from then on), which the messages
        // below fill with the sum in place.
        let mut flat = Flat::gather(params, &everything, device, scale)?;
        let wait = |work: Result<Work, crate::comm::CommError>| -> Result<(), String> {
            work.map_err(|e| e.to_string())?.wait().map_err(|e| e.to_string())
        };
        match (&self.local, self.is_master()) {
            (Some(local), false) => {
                wait(local.send(&flat.tensor, 0, UP))?;
                wait(local.recv(&mut flat.tensor, 0, DOWN))?;
            }
            (local, _) => {
                if let Some(local) = local {
                    // Every member's message is posted before any is waited for; the sum goes in
                    // rank order, so every run adds the same numbers in the same order.
                    let mut posted = Vec::with_capacity(local.size() - 1);
                    for member in 1..local.size() {
                        let mut buffer = flat.tensor.empty_like();
                        let work = local.recv(&mut buffer, member, UP).map_err(|e| e.to_string())?;
                        posted.push((buffer, work));
                    }
                    for (buffer, work) in posted {
                        work.wait().map_err(|e| e.to_string())?;
                        tch::no_grad(|| flat.tensor.f_add_(&buffer).map(drop)).map_err(|e| e.to_string())?;
                    }
                }
                if let Some(masters) = &self.masters {
                    wait(masters.all_reduce_sum(std::slice::from_ref(&flat.tensor)))?;
                }
                if let Some(local) = local {
                    let sends = (1..local.size())
                        .map(|member| local.send(&flat.tensor, member, DOWN).map_err(|e| e.to_string()))
                        .collect::<Result<Vec<_>, _>>()?;
                    for work in sends {
                        work.wait().map_err(|e| e.to_string())?;
                    }
                }
            }
        }
        flat.scatter(params)?;
        crate::cuda::synchronize(device)?;
        let bytes = flat.bytes();
        let sent = match (&self.local, self.is_master()) {
            (Some(_), false) => bytes,
            (local, _) => {
                let members = local.as_ref().map_or(0, |g| g.size() as u64 - 1);
                members * bytes + self.masters.as_ref().map_or(0, |g| ring_bytes(bytes, g.size()))
            }
        };
        Ok(ReduceStats {
            buckets: 1,
            wait: started.elapsed(),
            sent,
            ..ReduceStats::default()
        })
    }
}
