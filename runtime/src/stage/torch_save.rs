//! Reads what `torch.save` writes for a dict of tensors (a `state_dict()`, an `OrderedDict`): a
//! zip archive of `<name>/data.pkl`, a pickle whose tensors point at storages, and the storages'
//! raw little-endian bytes in `<name>/data/<key>`. libtorch's own unpickler turns the
//! `OrderedDict` every state dict is into `None`, so this is a small pickle machine of its own:
//! the opcodes pickle protocols 2 to 4 use for such a dict, `OrderedDict`,
//! `torch._utils._rebuild_tensor_v2` and `_rebuild_parameter`, and storages by persistent id.
//! Anything else in the file (other objects, metadata) is carried as opaque and ignored.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use tch::{Kind, Tensor};

#[derive(Debug, Clone)]
enum Value {
    None,
    Int(i64),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Global(String, String),
    Storage { key: String, kind: Kind },
    Tensor(TensorRef),
    Mark,
    Opaque,
}

#[derive(Debug, Clone)]
struct TensorRef {
    key: String,
    kind: Kind,
    offset: i64,
    size: Vec<i64>,
    stride: Vec<i64>,
}

fn storage_kind(class: &str) -> Option<Kind> {
    Some(match class {
        "FloatStorage" => Kind::Float,
        "DoubleStorage" => Kind::Double,
        "HalfStorage" => Kind::Half,
        "BFloat16Storage" => Kind::BFloat16,
        "LongStorage" => Kind::Int64,
        "IntStorage" => Kind::Int,
        "ShortStorage" => Kind::Int16,
        "CharStorage" => Kind::Int8,
        "ByteStorage" => Kind::Uint8,
        "BoolStorage" => Kind::Bool,
        _ => return None,
    })
}

fn ints(v: &Value) -> Result<Vec<i64>, String> {
    match v {
        Value::Tuple(items) | Value::List(items) => items
            .iter()
            .map(|i| match i {
                Value::Int(n) => Ok(*n),
                other => Err(format!("expected an integer, found {other:?}")),
            })
            .collect(),
        other => Err(format!("expected a tuple of integers, found {other:?}")),
    }
}

struct Machine<'a> {
    data: &'a [u8],
    at: usize,
    stack: Vec<Value>,
    memo: HashMap<u32, Value>,
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at + n;
        let bytes = self.data.get(self.at..end).ok_or("the pickle ends early")?;
        self.at = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn line(&mut self) -> Result<String, String> {
        let rest = &self.data[self.at..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("unterminated line in the pickle")?;
        let text = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.at += n + 1;
        Ok(text)
    }

    fn pop(&mut self) -> Result<Value, String> {
        self.stack
            .pop()
            .ok_or_else(|| "the pickle's stack is empty".to_string())
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let mark = self
            .stack
            .iter()
            .rposition(|v| matches!(v, Value::Mark))
            .ok_or("no mark on the pickle's stack")?;
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items)
    }

    fn top(&mut self) -> Result<&mut Value, String> {
        self.stack
            .last_mut()
            .ok_or_else(|| "the pickle's stack is empty".to_string())
    }

    fn memoize(&mut self, index: u32) -> Result<(), String> {
        let top = self.top()?.clone();
        self.memo.insert(index, top);
        Ok(())
    }

    /// Pushes memo entry `index` again.
    fn recall(&mut self, index: u32) -> Result<(), String> {
        let v = self
            .memo
            .get(&index)
            .cloned()
            .ok_or("a pickle memo entry is missing")?;
        self.stack.push(v);
        Ok(())
    }

    fn reduce(callable: Value, args: Value) -> Result<Value, String> {
        let Value::Global(module, name) = callable else {
            return Ok(Value::Opaque);
        };
        let args = match args {
            Value::Tuple(a) => a,
            _ => return Ok(Value::Opaque),
        };
        Ok(match (module.as_str(), name.as_str()) {
            ("collections", "OrderedDict") => Value::Dict(Vec::new()),
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
                let Some(Value::Storage { key, kind }) = args.first().cloned() else {
                    return Err("a tensor without its storage".into());
                };
                let offset = match args.get(1) {
                    Some(Value::Int(o)) => *o,
                    _ => return Err("a tensor without its storage offset".into()),
                };
                let size = ints(args.get(2).ok_or("a tensor without its size")?)?;
                let stride = ints(args.get(3).ok_or("a tensor without its stride")?)?;
                Value::Tensor(TensorRef {
                    key,
                    kind,
                    offset,
                    size,
                    stride,
                })
            }
            ("torch._utils", "_rebuild_parameter") | ("torch._utils", "_rebuild_parameter_with_state") => {
                args.into_iter().next().unwrap_or(Value::None)
            }
            _ => Value::Opaque,
        })
    }

    fn run(&mut self) -> Result<Value, String> {
        loop {
            let op = self.u8()?;
            match op {
                0x80 => drop(self.u8()?),    // PROTO
                0x95 => drop(self.take(8)?), // FRAME
                b'}' => self.stack.push(Value::Dict(Vec::new())),
                b']' => self.stack.push(Value::List(Vec::new())),
                b')' => self.stack.push(Value::Tuple(Vec::new())),
                b'(' => self.stack.push(Value::Mark),
                b'N' => self.stack.push(Value::None),
                0x88 | 0x89 => self.stack.push(Value::Opaque), // booleans: requires_grad and the like
                b'K' => {
                    let n = self.u8()?;
                    self.stack.push(Value::Int(n as i64))
                }
                b'M' => {
                    let b: [u8; 2] = self.take(2)?.try_into().expect("2 bytes");
                    self.stack.push(Value::Int(u16::from_le_bytes(b) as i64))
                }
                b'J' => {
                    let n = self.u32()? as i32;
                    self.stack.push(Value::Int(n as i64))
                }
                0x8a => {
                    // LONG1: little-endian two's complement of n bytes.
                    let n = self.u8()? as usize;
                    let bytes = self.take(n)?.to_vec();
                    if n > 8 {
                        return Err("an integer too large in the pickle".into());
                    }
                    let mut buf = [if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                        0xff
                    } else {
                        0
                    }; 8];
                    buf[..n].copy_from_slice(&bytes);
                    self.stack.push(Value::Int(i64::from_le_bytes(buf)))
                }
                b'G' => {
                    // A float: no tensor's layout needs one.
                    self.take(8)?;
                    self.stack.push(Value::Opaque)
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let s = String::from_utf8_lossy(self.take(n)?).into_owned();
                    self.stack.push(Value::Str(s))
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    let s = String::from_utf8_lossy(self.take(n)?).into_owned();
                    self.stack.push(Value::Str(s))
                }
                b'B' => {
                    let n = self.u32()? as usize;
                    self.take(n)?;
                    self.stack.push(Value::Opaque)
                }
                b'C' => {
                    let n = self.u8()? as usize;
                    self.take(n)?;
                    self.stack.push(Value::Opaque)
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.stack.push(Value::Global(module, name))
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.stack.push(Value::Global(m, n)),
                        _ => self.stack.push(Value::Opaque),
                    }
                }
                b'q' => {
                    let i = self.u8()? as u32;
                    self.memoize(i)?
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memoize(i)?
                }
                0x94 => {
                    let i = self.memo.len() as u32;
                    self.memoize(i)?
                }
                b'h' => {
                    let i = self.u8()? as u32;
                    self.recall(i)?
                }
                b'j' => {
                    let i = self.u32()?;
                    self.recall(i)?
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(items))
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let at = self
                        .stack
                        .len()
                        .checked_sub(n)
                        .ok_or("the pickle's stack is empty")?;
                    let items = self.stack.split_off(at);
                    self.stack.push(Value::Tuple(items))
                }
                b'Q' => {
                    // BINPERSID: ('storage', <class>, key, location, numel).
                    let pid = self.pop()?;
                    let Value::Tuple(items) = pid else {
                        return Err("a persistent id that is not a tuple".into());
                    };
                    let storage = match (items.get(1), items.get(2)) {
                        (Some(Value::Global(_, class)), Some(Value::Str(key))) => Value::Storage {
                            key: key.clone(),
                            kind: storage_kind(class)
                                .ok_or_else(|| format!("tensors of {class} are not supported"))?,
                        },
                        _ => return Err("a persistent id that is not a storage".into()),
                    };
                    self.stack.push(storage)
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.stack.push(Self::reduce(callable, args)?)
                }
                b'b' => {
                    // BUILD: the state of an OrderedDict (its `_metadata`) and of opaque objects.
                    self.pop()?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    if let Value::Dict(d) = self.top()? {
                        d.push((key, value));
                    }
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    if let Value::Dict(d) = self.top()? {
                        let mut it = items.into_iter();
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            d.push((k, v));
                        }
                    }
                }
                b'a' => {
                    let v = self.pop()?;
                    if let Value::List(l) = self.top()? {
                        l.push(v);
                    }
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    if let Value::List(l) = self.top()? {
                        l.extend(items);
                    }
                }
                b'.' => return self.pop(),
                other => return Err(format!("pickle opcode 0x{other:02x} is not supported")),
            }
        }
    }
}

/// The named tensors of a `torch.save` archive of a dict of tensors; a dict holding the state
/// dict under `state_dict` or `model` (as training checkpoints do) is looked into.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| {
        format!("not a torch.save zip archive ({e}); files of torch < 1.6's format are not read")
    })?;
    let pickle_name = (0..archive.len())
        .filter_map(|i| archive.by_index(i).ok().map(|f| f.name().to_string()))
        .find(|n| n.ends_with("/data.pkl") || n == "data.pkl")
        .ok_or("the archive has no data.pkl")?;
    let prefix = pickle_name.trim_end_matches("data.pkl").to_string();
    let pickle = entry(&mut archive, &pickle_name)?;
    let mut machine = Machine {
        data: &pickle,
        at: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    let top = machine.run()?;
    let dict = match top {
        Value::Dict(d) => d,
        other => {
            return Err(format!(
                "the file holds a {} rather than a dict of tensors",
                kind_name(&other)
            ))
        }
    };
    let holds_tensors = dict.iter().any(|(_, v)| matches!(v, Value::Tensor(_)));
    let dict = if holds_tensors {
        dict
    } else {
        dict.into_iter()
            .find_map(|(k, v)| match (k, v) {
                (Value::Str(k), Value::Dict(inner)) if k == "state_dict" || k == "model" => Some(inner),
                _ => None,
            })
            .ok_or("the file's dict holds no tensors (nor a `state_dict` or `model` dict of them)")?
    };
    let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
    let mut out = Vec::new();
    for (key, value) in dict {
        let (Value::Str(name), Value::Tensor(t)) = (key, value) else {
            continue;
        };
        if !storages.contains_key(&t.key) {
            let bytes = entry(&mut archive, &format!("{prefix}data/{}", t.key))
                .map_err(|e| format!("storage {} of `{name}`: {e}", t.key))?;
            storages.insert(t.key.clone(), bytes);
        }
        let bytes = &storages[&t.key];
        let elt = t.kind.elt_size_in_bytes();
        let numel = (bytes.len() / elt) as i64;
        let storage =
            Tensor::f_from_data_size(bytes, &[numel], t.kind).map_err(|e| format!("`{name}`: {e}"))?;
        let tensor = storage
            .f_as_strided(&t.size, &t.stride, Some(t.offset))
            .map_err(|e| format!("`{name}`: {e}"))?
            .contiguous();
        out.push((name, tensor));
    }
    Ok(out)
}

/// The bytes of the archive's entry `name`.
fn entry(archive: &mut zip::ZipArchive<std::fs::File>, name: &str) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    archive
        .by_name(name)
        .map_err(|e| e.to_string())?
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Int(_) => "integer",
        Value::Str(_) => "string",
        Value::Tuple(_) => "tuple",
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Tensor(_) => "single tensor",
        Value::Global(..) | Value::Storage { .. } | Value::Mark | Value::Opaque => "Python object",
    }
}
