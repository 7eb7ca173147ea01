//! What crosses stage boundaries: the messages (their tags and channels) and the shape headers
//! exchanged at start, so receivers allocate buffers of whatever shape the model produces.

use stagehand_contract::{Channel, P2pTensor};
use tch::{Device, Kind, Tensor};

/// One tensor that crosses a stage boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Message {
    /// The shapes a stage sends each rank of the next stage once, before the first microbatch.
    Header,
    /// A stage's output for global microbatch `g`.
    Activation(usize),
    /// Microbatch `g`'s targets, carried along to the last stage.
    Target(usize),
    /// The gradient of the loss with respect to a stage's input for microbatch `g`.
    Gradient(usize),
}

impl Message {
    /// The c10d tag: unique per kind and global microbatch (gloo matches by it; NCCL ignores it).
    pub fn tag(self) -> u32 {
        let (microbatch, kind) = match self {
            Message::Activation(g) => (g, 0),
            Message::Target(g) => (g, 1),
            Message::Gradient(g) => (g, 2),
            Message::Header => (0, 3),
        };
        ((microbatch as u64 * 4 + kind) % (1 << 31)) as u32
    }

    /// The tag of a compressed message's payload (its header goes with [`Message::tag`]):
    /// in the upper half of the tag space, which the plain tags reach only after 2^28 microbatches.
    pub fn payload_tag(self) -> u32 {
        (self.tag() + (1 << 30)) % (1 << 31)
    }

    /// The channel it travels on: downstream traffic on one group, upstream on another, so that
    /// between two ranks each group carries messages one way only.
    pub fn channel(self) -> Channel {
        match self {
            Message::Header | Message::Activation(_) | Message::Target(_) => Channel::Forward,
            Message::Gradient(_) => Channel::Backward,
        }
    }

    /// What the `p2p` metrics event calls it, and its microbatch.
    pub fn describe(self) -> (P2pTensor, Option<u64>) {
        match self {
            Message::Header => (P2pTensor::Header, None),
            Message::Activation(g) => (P2pTensor::Activation, Some(g as u64)),
            Message::Target(g) => (P2pTensor::Target, Some(g as u64)),
            Message::Gradient(g) => (P2pTensor::Gradient, Some(g as u64)),
        }
    }
}

const MAX_DIMS: usize = 8;
const HEADER_LEN: i64 = 2 * (MAX_DIMS as i64 + 3);

/// How a tensor that crosses a boundary is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Strided,
    /// PyTorch's sparse COO layout over the first `sparse_dims` dimensions (a model that makes
    /// its activations sparse).
    Coo {
        sparse_dims: i64,
    },
}

/// Shape, element type and layout of a tensor that crosses a boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub shape: Vec<i64>,
    pub kind: Kind,
    pub layout: Layout,
}

impl TensorSpec {
    /// A strided (dense) tensor's spec.
    pub fn dense(shape: Vec<i64>, kind: Kind) -> TensorSpec {
        TensorSpec {
            shape,
            kind,
            layout: Layout::Strided,
        }
    }

    pub fn of(tensor: &Tensor) -> TensorSpec {
        TensorSpec {
            shape: tensor.size(),
            kind: tensor.kind(),
            layout: match tensor.is_sparse() {
                true => Layout::Coo {
                    sparse_dims: tensor.sparse_dim(),
                },
                false => Layout::Strided,
            },
        }
    }

    pub fn empty(&self, device: Device) -> Tensor {
        Tensor::empty(self.shape.as_slice(), (self.kind, device))
    }

    /// A tensor of zeros of the spec (with no entries when sparse).
    pub fn zeros(&self, device: Device) -> Tensor {
        let zeros = Tensor::zeros(self.shape.as_slice(), (self.kind, device));
        match self.layout {
            Layout::Strided => zeros,
            Layout::Coo { sparse_dims } => zeros.to_sparse_sparse_dim(sparse_dims),
        }
    }

    /// Whether its size varies from message to message (a sparse tensor's entries), so it
    /// travels framed: a header, then the payload the header announces.
    pub fn is_sparse(&self) -> bool {
        matches!(self.layout, Layout::Coo { .. })
    }

    fn encode(&self, out: &mut Vec<i64>) -> Result<(), String> {
        if self.shape.len() > MAX_DIMS {
            return Err(format!(
                "a tensor of {} dimensions crosses a stage boundary; at most {MAX_DIMS} are supported",
                self.shape.len()
            ));
        }
        out.push(self.shape.len() as i64);
        out.push(
            kind_code(self.kind)
                .ok_or_else(|| format!("tensors of kind {:?} cannot cross a stage boundary", self.kind))?,
        );
        // 0 for strided, else the COO tensor's sparse dimensions (at least one).
        out.push(match self.layout {
            Layout::Strided => 0,
            Layout::Coo { sparse_dims } => sparse_dims.max(1),
        });
        out.extend(self.shape.iter().copied());
        out.extend(std::iter::repeat_n(0, MAX_DIMS - self.shape.len()));
        Ok(())
    }

    fn decode(values: &[i64]) -> Option<TensorSpec> {
        let ndim = usize::try_from(values[0]).ok().filter(|&n| n <= MAX_DIMS)?;
        let layout = match values[2] {
            0 => Layout::Strided,
            d if (1..=ndim as i64).contains(&d) => Layout::Coo { sparse_dims: d },
            _ => return None,
        };
        Some(TensorSpec {
            kind: code_kind(values[1])?,
            layout,
            shape: values[3..3 + ndim].to_vec(),
        })
    }
}

/// The header a stage sends downstream at start: its output and the target's spec.
pub fn header(output: &TensorSpec, target: &TensorSpec) -> Result<Tensor, String> {
    let mut values = Vec::with_capacity(HEADER_LEN as usize);
    output.encode(&mut values)?;
    target.encode(&mut values)?;
    Ok(Tensor::from_slice(&values))
}

/// An empty header buffer to receive into.
pub fn header_buffer() -> Tensor {
    Tensor::zeros([HEADER_LEN], (Kind::Int64, Device::Cpu))
}

/// Reads a received header back into (activation, target) specs.
pub fn read_header(header: &Tensor) -> Option<(TensorSpec, TensorSpec)> {
    let values = Vec::<i64>::try_from(header).ok()?;
    let half = values.len() / 2;
    Some((
        TensorSpec::decode(&values[..half])?,
        TensorSpec::decode(&values[half..])?,
    ))
}

fn kind_code(kind: Kind) -> Option<i64> {
    Some(match kind {
        Kind::Float => 0,
        Kind::Int64 => 1,
        Kind::Half => 2,
        Kind::BFloat16 => 3,
        Kind::Double => 4,
        Kind::Int => 5,
        _ => return None,
    })
}

fn code_kind(code: i64) -> Option<Kind> {
    Some(match code {
        0 => Kind::Float,
        1 => Kind::Int64,
        2 => Kind::Half,
        3 => Kind::BFloat16,
        4 => Kind::Double,
        5 => Kind::Int,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn headers_round_trip() {
        let out = TensorSpec::dense(vec![4, 512, 7, 7], Kind::Float);
        let target = TensorSpec::dense(vec![4, 128], Kind::Int64);
        let h = header(&out, &target).unwrap();
        assert_eq!(h.size(), [HEADER_LEN]);
        assert_eq!(read_header(&h), Some((out.clone(), target.clone())));
        // A sparse COO activation keeps its layout, and zeros of it have no entries.
        let sparse = TensorSpec::of(&Tensor::eye(4, (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2));
        assert_eq!(sparse.layout, Layout::Coo { sparse_dims: 2 });
        assert_eq!(
            read_header(&header(&sparse, &target).unwrap()),
            Some((sparse.clone(), target))
        );
        let zeros = sparse.zeros(Device::Cpu);
        assert!(zeros.is_sparse() && zeros.internal_nnz() == 0 && zeros.size() == [4, 4]);
        let too_deep = TensorSpec::dense(vec![1; 9], Kind::Float);
        assert!(header(&too_deep, &too_deep).unwrap_err().contains("9 dimensions"));
    }

    #[test]
    fn tags_differ_per_kind_and_microbatch() {
        let tags: HashSet<u32> = (0..100)
            .flat_map(|g| {
                [Message::Activation(g), Message::Target(g), Message::Gradient(g)].map(Message::tag)
            })
            .chain([Message::Header.tag()])
            .collect();
        assert_eq!(tags.len(), 301);
    }

    #[test]
    fn gradients_travel_upstream_on_their_own_channel() {
        for g in [0, 7] {
            assert_eq!(Message::Activation(g).channel(), Channel::Forward);
            assert_eq!(Message::Target(g).channel(), Channel::Forward);
            assert_eq!(Message::Gradient(g).channel(), Channel::Backward);
        }
        assert_eq!(Message::Header.channel(), Channel::Forward);
        assert_eq!(Message::Target(3).describe(), (P2pTensor::Target, Some(3)));
        assert_eq!(Message::Header.describe(), (P2pTensor::Header, None));
    }
}
