//! Synthetic data, deterministic from the seed and the shard.
//!
//! Images are a class's low-resolution prototype, upsampled, plus noise, so the task is learnable
//! and the loss falls. Tokens map to targets by a fixed permutation-like rule the model can learn.
//! A small pool of batches is made up front and cycled, so making data costs nothing per step.

use tch::{Device, Kind, Tensor};

use super::{BatchRequest, Batches, DataError};
use crate::models::InputKind;

const POOL_BATCHES: usize = 4;

pub struct Synthetic {
    pool: Vec<(Tensor, Tensor)>,
    next: usize,
}

impl Synthetic {
    pub fn new(r: BatchRequest) -> Synthetic {
        let seed = r.seed.wrapping_mul(7919).wrapping_add(r.shard.index as u64 + 1);
        let generator_seed = (seed & (i64::MAX as u64)) as i64;
        let batch = r.batch_size as i64;
        let cpu = (Kind::Float, Device::Cpu);
        let pool = crate::models::seeded(generator_seed, || {
            let _no_grad = tch::no_grad_guard();
            match r.input {
                InputKind::Image { size, classes } => {
                    let prototypes = Tensor::randn([classes, 3, 4, 4], cpu);
                    (0..POOL_BATCHES)
                        .map(|_| {
                            let labels = Tensor::randint(classes, [batch], (Kind::Int64, Device::Cpu));
                            let base = prototypes.index_select(0, &labels).upsample_nearest2d(
                                [size, size],
                                None,
                                None,
                            );
                            let images = base + Tensor::randn([batch, 3, size, size], cpu) * 0.5;
                            (images.to_device(r.device), labels.to_device(r.device))
                        })
                        .collect()
                }
                InputKind::Tokens { seq_len, vocab } => (0..POOL_BATCHES)
                    .map(|_| {
                        let ids = Tensor::randint(vocab, [batch, seq_len], (Kind::Int64, Device::Cpu));
                        let targets = (&ids * 7 + 3).remainder(vocab);
                        (ids.to_device(r.device), targets.to_device(r.device))
                    })
                    .collect(),
            }
        });
        Synthetic { pool, next: 0 }
    }
}

impl Batches for Synthetic {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError> {
        let (x, y) = &self.pool[self.next % self.pool.len()];
        self.next += 1;
        Ok((x.shallow_clone(), y.shallow_clone()))
    }
}
