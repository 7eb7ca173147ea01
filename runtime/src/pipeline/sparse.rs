//! Sparse transfers (SparsePipedream's idea, `--compress auto`): an activation or gradient that
//! crosses a stage boundary travels in whichever of three forms is smallest for its measured
//! density, and the receiver rebuilds the exact dense tensor, bit for bit.
//!
//! With `n` elements of `e` bytes, `k` of them not all-zero bits:
//! - dense: the `n * e` bytes as they are;
//! - indices: `k` int32 positions then the `k` values (`k * (4 + e)` bytes);
//! - bitmask: one bit per element (`ceil(n / 8)` bytes, bit `i % 8` of byte `i / 8`) then the `k`
//!   values (`ceil(n / 8) + k * e` bytes).
//!
//! "Zero" means all bits zero, so -0.0 and NaN are values like any other and survive the trip.
//! Each message is two transfers: a three-number header (form, `k`, payload bytes) with the
//! message's tag, then the payload of exactly that many bytes with a tag of its own.

use tch::{Device, Kind, Tensor};

/// How a message's payload is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Dense = 0,
    Indices = 1,
    Bitmask = 2,
}

impl Form {
    fn from_code(code: i64) -> Option<Form> {
        match code {
            0 => Some(Form::Dense),
            1 => Some(Form::Indices),
            2 => Some(Form::Bitmask),
            _ => None,
        }
    }
}

/// A message ready to send: its header (int64 on the CPU) and its payload bytes.
pub struct Encoded {
    pub header: Tensor,
    pub payload: Tensor,
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

/// Payload bytes of each form for `n` elements of `elt` bytes, `k` of them nonzero.
pub fn sizes(n: i64, k: i64, elt: i64) -> [(Form, i64); 3] {
    [
        (Form::Dense, n * elt),
        (Form::Indices, k * (4 + elt)),
        (Form::Bitmask, (n + 7) / 8 + k * elt),
    ]
}

/// Bit weights 1, 2, 4, ..., 128 of a packed byte.
fn bit_weights(device: Device) -> Tensor {
    Tensor::from_slice(&[1u8, 2, 4, 8, 16, 32, 64, 128]).to_device(device)
}

/// Encodes `tensor` in its smallest form (dense on a tie, then indices).
pub fn encode(tensor: &Tensor) -> Result<Encoded, String> {
    let kind = tensor.kind();
    let elt = kind.elt_size_in_bytes() as i64;
    let flat = tensor.detach().contiguous().reshape([-1]);
    let n = flat.numel() as i64;
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
    let as_bytes = |t: &Tensor| t.f_view_dtype(Kind::Uint8).map_err(|e| e.to_string());
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
    };
    debug_assert_eq!(payload.numel() as i64, len);
    Ok(Encoded {
        header: Tensor::from_slice(&[form as i64, k, len]),
        payload,
    })
}

/// What a received header says: the form, the nonzero count and the payload's bytes.
pub fn read_header(header: &Tensor) -> Result<(Form, i64, i64), String> {
    let values = Vec::<i64>::try_from(header.to_device(Device::Cpu)).map_err(|e| e.to_string())?;
    match values.as_slice() {
        &[form, k, len] if k >= 0 && len >= 0 => Ok((
            Form::from_code(form).ok_or_else(|| format!("unknown compressed form {form}"))?,
            k,
            len,
        )),
        other => Err(format!("malformed compressed-message header {other:?}")),
    }
}

/// Rebuilds the dense tensor of `shape` and `kind` from a payload of `form` with `k` nonzeros.
pub fn decode(form: Form, k: i64, payload: &Tensor, shape: &[i64], kind: Kind) -> Result<Tensor, String> {
    let elt = kind.elt_size_in_bytes() as i64;
    let n: i64 = shape.iter().product();
    let expected = sizes(n, k, elt)[form as usize].1;
    if payload.numel() as i64 != expected {
        return Err(format!(
            "a compressed message of {} bytes, {expected} expected for {form:?} with {k} of {n} nonzero",
            payload.numel()
        ));
    }
    let device = payload.device();
    // A slice of the payload starts at any byte: copied to storage of its own to view it as
    // wider elements.
    let values_of = |bytes: Tensor| bytes.copy().f_view_dtype(kind).map_err(|e| e.to_string());
    let flat = match form {
        Form::Dense => values_of(payload.shallow_clone())?,
        Form::Indices => {
            let positions = payload
                .narrow(0, 0, 4 * k)
                .copy()
                .f_view_dtype(Kind::Int)
                .map_err(|e| e.to_string())?
                .to_kind(Kind::Int64);
            let values = values_of(payload.narrow(0, 4 * k, k * elt))?;
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
            let values = values_of(payload.narrow(0, mask_bytes, k * elt))?;
            let mut dense = Tensor::zeros([n], (kind, device));
            let _ = dense.masked_scatter_(&mask, &values);
            dense
        }
    };
    Ok(flat.reshape(shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(t: &Tensor) -> (Form, Tensor) {
        let e = encode(t).unwrap();
        let (form, k, len) = read_header(&e.header).unwrap();
        assert_eq!(len, e.payload.numel() as i64);
        (form, decode(form, k, &e.payload, &t.size(), t.kind()).unwrap())
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
        let e = encode(&t).unwrap();
        let (form, k, _) = read_header(&e.header).unwrap();
        let short = e.payload.narrow(0, 0, e.payload.numel() as i64 - 1);
        let err = decode(form, k, &short, &[8], Kind::Float).unwrap_err();
        assert!(err.contains("expected"), "{err}");
        assert!(read_header(&Tensor::from_slice(&[7i64, 0, 0])).is_err());
    }
}
