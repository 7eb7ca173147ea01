//! Synthetic data, deterministic from the seed and the shard.
//!
//! Images are a class's low-resolution prototype, upsampled, plus noise, so the task is learnable
//! and the loss falls. Tokens map to targets by a fixed permutation-like rule the model can learn.
//! A small pool of batches is made up front and cycled, so making data costs nothing per step.
//! The held-out split ([`Synthetic::held_out`]) draws new samples of the same prototypes and
//! rule, a batch at a time.

use tch::{Device, Kind, Tensor};

use super::{BatchRequest, Batches, DataError};
use crate::models::InputKind;

const POOL_BATCHES: usize = 4;

/// Minibatches in a validation pass over synthetic data when `--validation-batches` is not given
/// (the split has no size of its own).
pub const HELD_OUT_BATCHES: u64 = 4;

pub struct Synthetic {
    source: Source,
    next: usize,
}

enum Source {
    /// The training pool, cycled.
    Pool(Vec<(Tensor, Tensor)>),
    /// Held-out batches, each drawn when taken from its own seed.
    HeldOut {
        prototypes: Option<Tensor>,
        request: BatchRequest,
        seed: i64,
    },
}

/// The generator's seed of a request's data (its prototypes first).
fn generator_seed(r: &BatchRequest) -> i64 {
    let seed = r.seed.wrapping_mul(7919).wrapping_add(r.shard.index as u64 + 1);
    (seed & (i64::MAX as u64)) as i64
}

/// A batch of `r`'s input kind: images of `prototypes`' classes, or tokens and their targets.
fn draw(r: &BatchRequest, prototypes: Option<&Tensor>) -> (Tensor, Tensor) {
    let batch = r.batch_size as i64;
    let cpu = (Kind::Float, Device::Cpu);
    match (r.input, prototypes) {
        (InputKind::Image { size, classes }, Some(prototypes)) => {
            let labels = Tensor::randint(classes, [batch], (Kind::Int64, Device::Cpu));
            let base = prototypes
                .index_select(0, &labels)
                .upsample_nearest2d([size, size], None, None);
            let images = base + Tensor::randn([batch, 3, size, size], cpu) * 0.5;
            (images.to_device(r.device), labels.to_device(r.device))
        }
        (InputKind::Tokens { seq_len, vocab }, _) => {
            let ids = Tensor::randint(vocab, [batch, seq_len], (Kind::Int64, Device::Cpu));
            let targets = (&ids * 7 + 3).remainder(vocab);
            (ids.to_device(r.device), targets.to_device(r.device))
        }
        (InputKind::Image { .. }, None) => unreachable!("image data is drawn with its prototypes"),
    }
}

/// The class prototypes of image data (the generator's first draw), none for tokens.
fn prototypes(r: &BatchRequest) -> Option<Tensor> {
    match r.input {
        InputKind::Image { classes, .. } => {
            Some(Tensor::randn([classes, 3, 4, 4], (Kind::Float, Device::Cpu)))
        }
        InputKind::Tokens { .. } => None,
    }
}

impl Synthetic {
    pub fn new(r: BatchRequest) -> Synthetic {
        let pool = crate::models::seeded(generator_seed(&r), || {
            let _no_grad = tch::no_grad_guard();
            let prototypes = prototypes(&r);
            (0..POOL_BATCHES).map(|_| draw(&r, prototypes.as_ref())).collect()
        });
        Synthetic {
            source: Source::Pool(pool),
            next: 0,
        }
    }

    /// The held-out split of the data [`Synthetic::new`] makes from the same request: samples
    /// of the same classes (prototypes) or rule, none of them in the training pool, the same
    /// sequence each time it is opened.
    pub fn held_out(r: BatchRequest) -> Synthetic {
        let seed = generator_seed(&r);
        let prototypes = crate::models::seeded(seed, || prototypes(&r));
        Synthetic {
            source: Source::HeldOut {
                prototypes,
                request: r,
                seed,
            },
            next: 0,
        }
    }
}

impl Batches for Synthetic {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError> {
        let batch = match &self.source {
            Source::Pool(pool) => {
                let (x, y) = &pool[self.next % pool.len()];
                (x.shallow_clone(), y.shallow_clone())
            }
            Source::HeldOut {
                prototypes,
                request,
                seed,
            } => {
                // Apart from the pool's seed, and from any other run seed's pool.
                let mixed = (*seed as u64 ^ 0x5bd1_e995_0000_0000).wrapping_add(self.next as u64 + 1);
                crate::models::seeded((mixed & (i64::MAX as u64)) as i64, || {
                    let _no_grad = tch::no_grad_guard();
                    draw(request, prototypes.as_ref())
                })
            }
        };
        self.next += 1;
        Ok(batch)
    }
}
