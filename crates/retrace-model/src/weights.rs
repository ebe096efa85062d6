//! Safetensors weights read tensor by tensor with positioned reads, as a candle `VarBuilder`
//! backend: unlike a memory map, the file's pages never count against the process, so loading
//! peaks at the converted weights plus one tensor (a mapped checkpoint peaked at twice the
//! weights: every mapped page touched stays resident until the map is dropped).

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Where one tensor lies.
struct Entry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in its file.
    start: u64,
    len: usize,
}

/// The tensors of one or more safetensors files (shards), by name.
pub(crate) struct FileTensors {
    files: Vec<File>,
    entries: HashMap<String, Entry>,
}

fn err(path: &Path, msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {msg}", path.display()))
}

fn dtype(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F64" => DType::F64,
        "U8" => DType::U8,
        "U32" => DType::U32,
        "I64" => DType::I64,
        _ => return None,
    })
}

impl FileTensors {
    /// Reads the headers of `paths` (the format: an 8-byte little-endian header length, a JSON
    /// header of `name: {dtype, shape, data_offsets}`, then the data).
    pub(crate) fn open(paths: &[impl AsRef<Path>]) -> Result<FileTensors> {
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let path = path.as_ref();
            let file = File::open(path).map_err(|e| err(path, e))?;
            let size = file.metadata().map_err(|e| err(path, e))?.len();
            let mut n = [0u8; 8];
            file.read_exact_at(&mut n, 0).map_err(|e| err(path, e))?;
            let n = u64::from_le_bytes(n);
            if n > size.saturating_sub(8) || n > 100 << 20 {
                return Err(err(path, format!("bad header length {n}")));
            }
            let mut header = vec![0u8; n as usize];
            file.read_exact_at(&mut header, 8)
                .map_err(|e| err(path, e))?;
            let header: HashMap<String, serde_json::Value> =
                serde_json::from_slice(&header).map_err(|e| err(path, e))?;
            let data_start = 8 + n;
            for (name, v) in header {
                if name == "__metadata__" {
                    continue;
                }
                let bad = |what: &str| err(path, format!("tensor {name}: bad {what}"));
                let dt = v
                    .get("dtype")
                    .and_then(|d| d.as_str())
                    .and_then(dtype)
                    .ok_or_else(|| bad("dtype"))?;
                let shape: Vec<usize> = v
                    .get("shape")
                    .and_then(|s| serde_json::from_value(s.clone()).ok())
                    .ok_or_else(|| bad("shape"))?;
                let [s, e]: [u64; 2] = v
                    .get("data_offsets")
                    .and_then(|o| serde_json::from_value(o.clone()).ok())
                    .ok_or_else(|| bad("data_offsets"))?;
                let len = shape.iter().product::<usize>() * dt.size_in_bytes();
                if e < s || (e - s) as usize != len || data_start + e > size {
                    return Err(bad("data_offsets"));
                }
                entries.insert(
                    name,
                    Entry {
                        file: i,
                        dtype: dt,
                        shape,
                        start: data_start + s,
                        len,
                    },
                );
            }
            files.push(file);
        }
        Ok(FileTensors { files, entries })
    }
}

impl SimpleBackend for FileTensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() }.bt())?;
        let mut bytes = vec![0u8; e.len];
        self.files[e.file]
            .read_exact_at(&mut bytes, e.start)
            .map_err(candle_core::Error::wrap)?;
        let t = Tensor::from_raw_buffer(&bytes, e.dtype, &e.shape, dev)?;
        drop(bytes);
        t.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
}
