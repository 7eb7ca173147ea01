//! Framed transfers: an activation or gradient that crosses a stage boundary as a header and a
//! payload of the size the header announces, for the two cases where the receiver cannot know the
//! size in advance.
//!
//! Sparse transfers (SparsePipedream's idea, `--compress auto`): a dense tensor travels in
//! whichever of three forms is smallest for its measured density, and the receiver rebuilds the
//! exact dense tensor, bit for bit. With `n` elements of `e` bytes, `k` of them not all-zero bits:
//! - dense: the `n * e` bytes as they are;
//! - indices: `k` int32 positions then the `k` values (`k * (4 + e)` bytes);
//! - bitmask: one bit per element (`ceil(n / 8)` bytes, bit `i % 8` of byte `i / 8`) then the `k`
//!   values (`ceil(n / 8) + k * e` bytes).
//!
//! "Zero" means all bits zero, so -0.0 and NaN are values like any other and survive the trip.
//!
//! Sparse COO tensors the model makes itself (PyTorch's `sparse_coo` layout) travel as such,
//! whatever `--compress` says: their `k` entries' int64 indices (`sparse_dims` rows of `k`) then
//! their values (`k` rows of the dense dimensions' elements), rebuilt as the same COO tensor,
//! coalesced or not as it was sent, so autograd on the other side does exactly what it would
//! have done in one process.
//!
//! Each message is two transfers: a four-number header (form, `k`, payload bytes, and for COO the
//! sparse dimensions and whether it is coalesced) with the message's tag, then the payload of
//! exactly that many bytes with a tag of its own.

use tch::{Device, Kind, Tensor};

/// How a message's payload is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Dense,
    Indices,
    Bitmask,
    /// A sparse COO tensor: indices then values.
    Coo {
        sparse_dims: i64,
        coalesced: bool,
    },
}

impl Form {
    fn code(self) -> [i64; 2] {
        match self {
            Form::Dense => [0, 0],
            Form::Indices => [1, 0],
            Form::Bitmask => [2, 0],
            Form::Coo {
                sparse_dims,
                coalesced,
            } => [3, 2 * sparse_dims + i64::from(coalesced)],
        }
    }

    fn from_code(code: i64, detail: i64) -> Option<Form> {
        match (code, detail) {
            (0, 0) => Some(Form::Dense),
            (1, 0) => Some(Form::Indices),
            (2, 0) => Some(Form::Bitmask),
            (3, d) if d >= 2 => Some(Form::Coo {
                sparse_dims: d / 2,
                coalesced: d % 2 == 1,
            }),
            _ => None,
        }
    }
}

/// The numbers in a header.
pub const HEADER_LEN: i64 = 4;

/// A message ready to send: its header (int64 on the CPU) and its payload bytes.
pub struct Encoded {
    pub header: Tensor,
    pub payload: Tensor,
}

/// What a received header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub form: Form,
    /// Elements (dense forms) or COO entries that are stored.
    pub nonzero: i64,
    /// The payload's bytes.
    pub bytes: i64,
}

impl Header {
    fn tensor(self) -> Tensor {
        let [code, detail] = self.form.code();
        Tensor::from_slice(&[code, self.nonzero, self.bytes, detail])
    }
}

/// The integer kind of the same width as `kind`, to test bits for zero.
fn bits_kind(kind: Kind) -> Result<Kind, String> {
    match kind.elt_size_in_bytes() {
        1 => Ok(Kind::Uint8),
        2 => Ok(Kind::Int16),
        4 => Ok(Kind::Int),
        8 => Ok(Kind::Int64),
        n => Err(format!("elements of {n} bytes ({kind:?}) cannot be compressed")),
    }
}

/// Payload bytes of each dense tensor's form for `n` elements of `elt` bytes, `k` of them nonzero.
pub fn sizes(n: i64, k: i64, elt: i64) -> [(Form, i64); 3] {
    [
        (Form::Dense, n * elt),
        (Form::Indices, k * (4 + elt)),
        (Form::Bitmask, (n + 7) / 8 + k * elt),
    ]
}

/// Payload bytes of a COO tensor of `shape` with `k` entries over its first `sparse_dims`
/// dimensions.
fn coo_size(shape: &[i64], sparse_dims: i64, k: i64, elt: i64) -> i64 {
    let row: i64 = shape[sparse_dims as usize..].iter().product();
    k * (sparse_dims * 8 + row * elt)
}

/// Bytes a sparse COO tensor weighs on the wire with its values in `values`: its header and its
/// entries.
pub fn coo_wire_bytes(t: &Tensor, values: Kind) -> u64 {
    let sparse_dims = t.sparse_dim();
    let k = t.internal_nnz();
    (HEADER_LEN * 8 + coo_size(&t.size(), sparse_dims, k, values.elt_size_in_bytes() as i64)) as u64
}

/// Bit weights 1, 2, 4, ..., 128 of a packed byte.
fn bit_weights(device: Device) -> Tensor {
    Tensor::from_slice(&[1u8, 2, 4, 8, 16, 32, 64, 128]).to_device(device)
}

fn as_bytes(t: &Tensor) -> Result<Tensor, String> {
    t.f_view_dtype(Kind::Uint8).map_err(|e| e.to_string())
}

/// Encodes `tensor`: a sparse COO tensor as such; a dense one in its smallest form (dense on a
/// tie, then indices) when `pick`, else dense.
pub fn encode(tensor: &Tensor, pick: bool) -> Result<Encoded, String> {
    if tensor.is_sparse() {
        return encode_coo(tensor);
    }
    let kind = tensor.kind();
    let elt = kind.elt_size_in_bytes() as i64;
    let flat = tensor.detach().contiguous().reshape([-1]);
    let n = flat.numel() as i64;
    if !pick {
        return Ok(Encoded {
            header: Header {
                form: Form::Dense,
                nonzero: n,
                bytes: n * elt,
            }
            .tensor(),
            payload: as_bytes(&flat)?,
        });
    }
    if n >= i32::MAX as i64 {
        return Err(format!("a tensor of {n} elements is too large to compress"));
    }
    let mask = flat
        .f_view_dtype(bits_kind(kind)?)
        .and_then(|bits| bits.f_ne(0))
        .map_err(|e| e.to_string())?;
    let k = mask.sum(Kind::Int64).int64_value(&[]);
    let (form, len) = sizes(n, k, elt)
        .into_iter()
        .min_by_key(|&(_, len)| len)
        .expect("three forms");
    let payload = match form {
        Form::Dense => as_bytes(&flat)?,
        Form::Indices => {
            let positions = mask.nonzero().reshape([-1]).to_kind(Kind::Int);
            let values = flat.masked_select(&mask);
            Tensor::cat(&[as_bytes(&positions)?, as_bytes(&values)?], 0)
        }
        Form::Bitmask => {
            let padded = (n + 7) / 8 * 8;
            let bits = mask
                .to_kind(Kind::Uint8)
                .constant_pad_nd([0, padded - n])
                .reshape([-1, 8]);
            let packed = (bits * bit_weights(flat.device())).sum_dim_intlist(1, false, Kind::Uint8);
            let values = flat.masked_select(&mask);
            Tensor::cat(&[packed, as_bytes(&values)?], 0)
        }
        Form::Coo { .. } => unreachable!("a dense tensor's forms are the three of sizes()"),
    };
    debug_assert_eq!(payload.numel() as i64, len);
    Ok(Encoded {
        header: Header {
            form,
            nonzero: k,
            bytes: len,
        }
        .tensor(),
        payload,
    })
}

/// A sparse COO tensor's entries as they are (not coalesced here: coalescing sums duplicates in
/// an order of its own, and the receiver must see what autograd produced).
fn encode_coo(tensor: &Tensor) -> Result<Encoded, String> {
    let t = tensor.detach();
    let sparse_dims = t.f_sparse_dim().map_err(|e| e.to_string())?;
    let coalesced = t.f_is_coalesced().map_err(|e| e.to_string())?;
    let indices = t.f_internal_indices().map_err(|e| e.to_string())?.contiguous();
    let values = t.f_internal_values().map_err(|e| e.to_string())?.contiguous();
    let k = indices.size()[1];
    let payload = Tensor::cat(
        &[
            as_bytes(&indices.reshape([-1]))?,
            as_bytes(&values.reshape([-1]))?,
        ],
        0,
    );
    let len = coo_size(&t.size(), sparse_dims, k, t.kind().elt_size_in_bytes() as i64);
    debug_assert_eq!(payload.numel() as i64, len);
    Ok(Encoded {
        header: Header {
            form: Form::Coo {
                sparse_dims,
                coalesced,
            },
            nonzero: k,
            bytes: len,
        }
        .tensor(),
        payload,
    })
}

/// An empty header buffer to receive into.
pub fn header_buffer() -> Tensor {
    Tensor::zeros([HEADER_LEN], (Kind::Int64, Device::Cpu))
}

/// What a received header says.
pub fn read_header(header: &Tensor) -> Result<Header, String> {
    let values = Vec::<i64>::try_from(header.to_device(Device::Cpu)).map_err(|e| e.to_string())?;
    match values.as_slice() {
        &[code, k, len, detail] if k >= 0 && len >= 0 => Ok(Header {
            form: Form::from_code(code, detail)
                .ok_or_else(|| format!("unknown compressed form {code} ({detail})"))?,
            nonzero: k,
            bytes: len,
        }),
        other => Err(format!("malformed compressed-message header {other:?}")),
    }
}

/// Rebuilds the tensor of `shape` and `kind` that a payload of `header`'s form carries: dense for
/// the three dense forms, sparse COO for COO.
pub fn decode(header: Header, payload: &Tensor, shape: &[i64], kind: Kind) -> Result<Tensor, String> {
    let Header { form, nonzero: k, .. } = header;
    let elt = kind.elt_size_in_bytes() as i64;
    let n: i64 = shape.iter().product();
    let expected = match form {
        Form::Coo { sparse_dims, .. } if sparse_dims as usize > shape.len() => {
            return Err(format!(
                "a COO tensor of {sparse_dims} sparse dimensions for a shape of {}",
                shape.len()
            ))
        }
        Form::Coo { sparse_dims, .. } => coo_size(shape, sparse_dims, k, elt),
        Form::Dense => n * elt,
        Form::Indices => sizes(n, k, elt)[1].1,
        Form::Bitmask => sizes(n, k, elt)[2].1,
    };
    if payload.numel() as i64 != expected || header.bytes != expected {
        return Err(format!(
            "a compressed message of {} bytes, {expected} expected for {form:?} with {k} of {n} nonzero",
            payload.numel()
        ));
    }
    let device = payload.device();
    // A slice of the payload starts at any byte: copied to storage of its own to view it as
    // wider elements.
    let view = |bytes: Tensor, kind: Kind| bytes.copy().f_view_dtype(kind).map_err(|e| e.to_string());
    let flat = match form {
        Form::Dense => view(payload.shallow_clone(), kind)?,
        Form::Indices => {
            let positions = view(payload.narrow(0, 0, 4 * k), Kind::Int)?.to_kind(Kind::Int64);
            let values = view(payload.narrow(0, 4 * k, k * elt), kind)?;
            let mut dense = Tensor::zeros([n], (kind, device));
            let _ = dense.index_put_(&[Some(positions)], &values, false);
            dense
        }
        Form::Bitmask => {
            let mask_bytes = (n + 7) / 8;
            let packed = payload.narrow(0, 0, mask_bytes);
            let mask = packed
                .unsqueeze(1)
                .bitwise_and_tensor(&bit_weights(device))
                .ne(0)
                .reshape([-1])
                .narrow(0, 0, n);
            let values = view(payload.narrow(0, mask_bytes, k * elt), kind)?;
            let mut dense = Tensor::zeros([n], (kind, device));
            let _ = dense.masked_scatter_(&mask, &values);
            dense
        }
        Form::Coo {
            sparse_dims,
            coalesced,
        } => return decode_coo(payload, shape, kind, k, sparse_dims, coalesced),
    };
    Ok(flat.reshape(shape))
}

fn decode_coo(
    payload: &Tensor,
    shape: &[i64],
    kind: Kind,
    k: i64,
    sparse_dims: i64,
    coalesced: bool,
) -> Result<Tensor, String> {
    let index_bytes = k * sparse_dims * 8;
    let indices = payload
        .narrow(0, 0, index_bytes)
        .copy()
        .f_view_dtype(Kind::Int64)
        .map_err(|e| e.to_string())?
        .reshape([sparse_dims, k]);
    // Indices index memory: one outside the shape is refused here, not left to corrupt it.
    if k > 0 {
        let low = indices.min().int64_value(&[]);
        let high = Vec::<i64>::try_from(indices.amax([1], false).to_device(Device::Cpu))
            .map_err(|e| e.to_string())?;
        let outside = high.iter().zip(shape).position(|(&h, &size)| h >= size);
        if low < 0 || outside.is_some() {
            return Err(format!(
                "a COO tensor whose indices fall outside its shape {shape:?} (lowest {low}, highest {high:?})"
            ));
        }
    }
    let mut values_shape = vec![k];
    values_shape.extend_from_slice(&shape[sparse_dims as usize..]);
    let values = payload
        .narrow(0, index_bytes, payload.numel() as i64 - index_bytes)
        .copy()
        .f_view_dtype(kind)
        .map_err(|e| e.to_string())?
        .reshape(values_shape);
    Tensor::f_internal_sparse_coo_tensor_unsafe(&indices, &values, shape, (kind, payload.device()), coalesced)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(t: &Tensor) -> (Form, Tensor) {
        let e = encode(t, true).unwrap();
        let header = read_header(&e.header).unwrap();
        assert_eq!(header.bytes, e.payload.numel() as i64);
        (
            header.form,
            decode(header, &e.payload, &t.size(), t.kind()).unwrap(),
        )
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        let kind = bits_kind(a.kind()).unwrap();
        a.size() == b.size() && a.view_dtype(kind).equal(&b.view_dtype(kind))
    }

    #[test]
    fn each_density_picks_its_smallest_form_and_comes_back_bit_for_bit() {
        // 1000 float32 elements from none to all nonzero: the form is the one sizes() finds
        // smallest (indices when very sparse, the bitmask in between, dense when full).
        let mut seen = Vec::new();
        for nonzero in [0usize, 10, 100, 300, 900, 1000] {
            let mut values = vec![0f32; 1000];
            for (i, v) in values.iter_mut().enumerate().take(nonzero) {
                *v = (i as f32 + 1.5) * if i % 2 == 0 { 1.0 } else { -1.0 };
            }
            let t = Tensor::from_slice(&values).reshape([10, 100]);
            let (form, back) = round_trip(&t);
            let best = sizes(1000, nonzero as i64, 4)
                .into_iter()
                .min_by_key(|s| s.1)
                .unwrap()
                .0;
            assert_eq!(form, best, "{nonzero} nonzero");
            assert!(same_bits(&t, &back), "{nonzero} nonzero as {form:?}");
            seen.push(form);
        }
        for form in [Form::Indices, Form::Bitmask, Form::Dense] {
            assert!(seen.contains(&form), "{form:?} never chosen: {seen:?}");
        }
    }

    #[test]
    fn negative_zero_nan_and_sixteen_bit_kinds_survive() {
        let mut values = vec![0f32; 64];
        values[3] = -0.0;
        values[17] = f32::NAN;
        values[40] = f32::INFINITY;
        values[63] = 1e-40; // subnormal
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let t = Tensor::from_slice(&values).to_kind(kind).reshape([4, 4, 4]);
            let (form, back) = round_trip(&t);
            assert_ne!(form, Form::Dense, "{kind:?}: 4 of 64 nonzero is sparse");
            assert!(same_bits(&t, &back), "{kind:?}");
        }
        // -0.0 is not zero: a tensor of -0.0 is dense.
        let t = Tensor::from_slice(&[-0.0f32; 16]);
        let (form, back) = round_trip(&t);
        assert_eq!(form, Form::Dense);
        assert!(same_bits(&t, &back));
    }

    #[test]
    fn a_payload_of_the_wrong_size_is_refused() {
        let t = Tensor::from_slice(&[0f32, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        let e = encode(&t, true).unwrap();
        let header = read_header(&e.header).unwrap();
        let short = e.payload.narrow(0, 0, e.payload.numel() as i64 - 1);
        let err = decode(header, &short, &[8], Kind::Float).unwrap_err();
        assert!(err.contains("expected"), "{err}");
        assert!(read_header(&Tensor::from_slice(&[7i64, 0, 0, 0])).is_err());
        assert!(read_header(&Tensor::from_slice(&[0i64, 0, 0])).is_err());
    }

    /// The same COO tensor: shape, kind, flags, and its indices and values as stored (bit for bit).
    fn assert_same_coo(sent: &Tensor, got: &Tensor) {
        assert!(got.is_sparse());
        assert_eq!(got.size(), sent.size());
        assert_eq!(got.kind(), sent.kind());
        assert_eq!(got.sparse_dim(), sent.sparse_dim());
        assert_eq!(got.is_coalesced(), sent.is_coalesced());
        assert!(got.internal_indices().equal(&sent.internal_indices()));
        assert!(same_bits(&got.internal_values(), &sent.internal_values()));
    }

    fn coo_round_trip(t: &Tensor) -> Tensor {
        // COO travels as such whether or not the dense forms are picked.
        for pick in [false, true] {
            let e = encode(t, pick).unwrap();
            let header = read_header(&e.header).unwrap();
            assert_eq!(
                header.form,
                Form::Coo {
                    sparse_dims: t.sparse_dim(),
                    coalesced: t.is_coalesced()
                }
            );
            assert_eq!(header.nonzero, t.internal_nnz());
            let got = decode(header, &e.payload, &t.size(), t.kind()).unwrap();
            assert_same_coo(t, &got);
        }
        encode(t, false).unwrap().payload
    }

    #[test]
    fn coo_tensors_travel_as_such_coalesced_or_not() {
        let dense = Tensor::from_slice(&[0f32, 1.5, 0.0, 0.0, -2.0, 0.0, 0.0, 0.0, 3.25, 0.0, 0.0, 0.0])
            .reshape([3, 4]);
        // Coalesced, as to_sparse makes it: 3 entries of two int64 indices and a float32 value.
        let coalesced = dense.to_sparse_sparse_dim(2);
        let payload = coo_round_trip(&coalesced);
        assert_eq!(payload.numel(), 3 * (2 * 8 + 4));
        // Not coalesced, with a duplicate entry: sent and rebuilt with the duplicate, so the
        // receiver sums it where autograd would have.
        let indices = Tensor::from_slice(&[0i64, 0, 2, 1, 1, 3]).reshape([2, 3]);
        let values = Tensor::from_slice(&[1f32, 2.0, -0.0]);
        let duplicated = Tensor::internal_sparse_coo_tensor_unsafe(
            &indices,
            &values,
            [3, 4],
            (Kind::Float, Device::Cpu),
            false,
        );
        assert_eq!(coo_round_trip(&duplicated).numel(), 3 * (2 * 8 + 4));
        // Hybrid (one sparse dimension, rows of dense values), bf16, and no entries at all.
        let rows = Tensor::arange(24, (Kind::Float, Device::Cpu))
            .reshape([4, 2, 3])
            .index_fill(0, &Tensor::from_slice(&[1i64, 2]), 0.0)
            .to_kind(Kind::BFloat16)
            .to_sparse_sparse_dim(1);
        assert_eq!(rows.internal_nnz(), 2);
        assert_eq!(coo_round_trip(&rows).numel(), 2 * (8 + 6 * 2));
        let empty = Tensor::zeros([5, 7], (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2);
        assert_eq!(coo_round_trip(&empty).numel(), 0);
    }

    #[test]
    fn a_dense_tensor_not_picked_travels_dense() {
        let t = Tensor::from_slice(&[0f32, 0.0, 0.0, 1.0]);
        let e = encode(&t, false).unwrap();
        let header = read_header(&e.header).unwrap();
        assert_eq!(header.form, Form::Dense);
        assert!(same_bits(
            &decode(header, &e.payload, &[4], Kind::Float).unwrap(),
            &t
        ));
    }

    #[test]
    fn coo_indices_outside_the_shape_are_refused() {
        let t = Tensor::from_slice(&[0f32, 1.0, 2.0, 0.0])
            .reshape([2, 2])
            .to_sparse_sparse_dim(2);
        let e = encode(&t, false).unwrap();
        let header = read_header(&e.header).unwrap();
        // The same payload read as a smaller shape: index 1 in a dimension of size 1.
        let err = decode(header, &e.payload, &[2, 1], Kind::Float).unwrap_err();
        assert!(err.contains("outside its shape"), "{err}");
        // More sparse dimensions than the shape has.
        let wide = Header {
            form: Form::Coo {
                sparse_dims: 3,
                coalesced: true,
            },
            ..header
        };
        assert!(decode(wide, &e.payload, &[2, 2], Kind::Float).is_err());
    }
}
