//! Where a stage's modules go when one rank holds its stage over several devices (`--devices`):
//! the stage config's `module_to_device_map`, or contiguous runs of even measured cost. The cost
//! of each module is its forward and backward time on the rank's first device at the
//! microbatch size, measured once at start (median of a few runs, each module built alone).

use std::ops::Range;
use std::time::Instant;

use tch::{nn, Device, Tensor};

use super::backward_with_grad;
use crate::models::ModelDef;

/// Runs of modules of even cost, one per device: `costs[i]` is module `range.start + i`'s
/// (the loss, if in the range, last, and kept with the module before it). Minimises the largest
/// run's cost (the step waits for the slowest device); each run holds at least one module.
pub fn split_by_cost(range: Range<usize>, costs: &[f64], parts: usize) -> Result<Vec<Range<usize>>, String> {
    let n = costs.len();
    assert_eq!(n, range.len(), "one cost per module");
    if parts == 0 || n < parts {
        return Err(format!(
            "the stage has {n} module(s) (modules {}..{}), fewer than the {parts} devices it is to span; \
             give fewer --devices or a stage with more modules",
            range.start, range.end
        ));
    }
    // best[k][i]: the smallest largest-run cost splitting the first i modules into k runs.
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |sum, c| {
            *sum += c;
            Some(*sum)
        }))
        .collect();
    let run = |a: usize, b: usize| prefix[b] - prefix[a];
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let cost = best[k - 1][j].max(run(j, i));
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ends = vec![n];
    for k in (1..=parts).rev() {
        let end = *ends.last().expect("at least the end");
        ends.push(cut[k][end]);
    }
    ends.reverse();
    Ok(ends
        .windows(2)
        .map(|w| range.start + w[0]..range.start + w[1])
        .collect())
}

/// Seconds per module of `range` (forward + backward at `micro` samples on `device`, median of
/// `repeats` after a warm-up); the loss module costs 0. The modules before `range` run once,
/// without gradients and each built alone, only to make this stage's input.
pub fn measure_costs(
    model: &ModelDef,
    range: Range<usize>,
    micro: i64,
    device: Device,
    repeats: usize,
) -> Vec<f64> {
    let layers_end = range.end.min(model.num_modules() - 1);
    let mut xs = model.example_input(micro).to_device(device);
    if xs.is_floating_point() {
        xs = crate::models::seeded(0, || xs.randn_like());
    }
    for index in 0..range.start {
        let vs = nn::VarStore::new(device);
        let layer = model
            .build(&vs.root(), index..index + 1, 0)
            .pop()
            .expect("one module");
        xs = tch::no_grad(|| layer.forward_t(&xs, true));
    }
    let mut costs = Vec::with_capacity(range.len());
    for index in range.start..layers_end {
        let vs = nn::VarStore::new(device);
        let layer = model
            .build(&vs.root(), index..index + 1, 0)
            .pop()
            .expect("one module");
        let input = if xs.is_floating_point() {
            xs.detach().set_requires_grad(true)
        } else {
            xs.detach()
        };
        // Timing boundaries; a device's fault is left to the next operation to report.
        let once = || {
            let _ = crate::cuda::synchronize(device);
            let started = Instant::now();
            let out = layer.forward_t(&input, true);
            if out.requires_grad() {
                let grad = match out.is_sparse() {
                    true => out.detach() * 1.0,
                    false => Tensor::ones_like(&out),
                };
                // A module's own output always takes a gradient of its shape.
                let _ = backward_with_grad(&out, &grad);
            }
            let _ = crate::cuda::synchronize(device);
            started.elapsed().as_secs_f64()
        };
        once();
        let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| once()).collect();
        times.sort_by(f64::total_cmp);
        costs.push(times[times.len() / 2]);
        xs = tch::no_grad(|| layer.forward_t(&input, true));
    }
    costs.resize(range.len(), 0.0);
    costs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_even_cost_minimise_the_slowest_device() {
        assert_eq!(
            split_by_cost(0..4, &[1.0, 1.0, 1.0, 1.0], 2).unwrap(),
            vec![0..2, 2..4]
        );
        // One heavy module alone on a device, the rest together.
        assert_eq!(
            split_by_cost(3..7, &[5.0, 1.0, 1.0, 1.0], 2).unwrap(),
            vec![3..4, 4..7]
        );
        assert_eq!(
            split_by_cost(0..5, &[3.0, 1.0, 2.0, 3.0, 0.0], 3).unwrap(),
            vec![0..1, 1..3, 3..5]
        );
        let e = split_by_cost(0..2, &[1.0, 0.0], 3).unwrap_err();
        assert!(e.contains("fewer than the 3 devices"), "{e}");
    }
}
