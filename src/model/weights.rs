//! Finding, validating and opening a checkpoint's safetensors files.
//!
//! Headers are checked here (dtype sizes, offsets, file length) before MLX
//! opens the files, so a truncated or corrupt file is reported by name and
//! size instead of failing later inside a forward pass.

use crate::error::{Error, Result};
use crate::mlx::{load_safetensors, Array, Dtype};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

/// All tensors of a checkpoint, by name, loaded lazily by MLX.
pub struct TensorStore {
    tensors: HashMap<String, Array>,
    taken: HashSet<String>,
    cast: Option<Dtype>,
    pub files: Vec<PathBuf>,
}

fn st_dtype_size(dt: &str) -> Option<usize> {
    Some(match dt {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

/// Reads and checks one file's header; returns its tensor names.
pub fn validate_safetensors(path: &Path) -> Result<Vec<String>> {
    let name = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| Error::load(format!("cannot open {name}: {e}")))?;
    let file_len = f.metadata()?.len();
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8)
        .map_err(|_| Error::load(format!("{name} is truncated: {file_len} bytes, too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n8);
    if n > 100 * 1024 * 1024 || 8 + n > file_len {
        return Err(Error::load(format!(
            "{name} is not a valid safetensors file (header length {n}, file length {file_len})"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let v: Value = serde_json::from_slice(&header)
        .map_err(|e| Error::load(format!("{name} has a corrupt safetensors header: {e}")))?;
    let obj = v.as_object().ok_or_else(|| Error::load(format!("{name}: safetensors header is not an object")))?;
    let mut data_end = 0u64;
    let mut names = Vec::new();
    for (tname, info) in obj {
        if tname == "__metadata__" {
            continue;
        }
        let dt = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let size = st_dtype_size(dt)
            .ok_or_else(|| Error::load(format!("{name}: tensor `{tname}` has unsupported dtype {dt}")))?;
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .ok_or_else(|| Error::load(format!("{name}: tensor `{tname}` has no shape")))?;
        let offs: Vec<u64> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| Error::load(format!("{name}: tensor `{tname}` has no data_offsets")))?;
        let want = shape.iter().product::<u64>() * size as u64;
        if offs[1] < offs[0] || offs[1] - offs[0] != want {
            return Err(Error::load(format!(
                "{name}: tensor `{tname}` of shape {shape:?} {dt} needs {want} bytes but its offsets span {}",
                offs[1].saturating_sub(offs[0])
            )));
        }
        data_end = data_end.max(offs[1]);
        names.push(tname.clone());
    }
    let need = 8 + n + data_end;
    if file_len < need {
        return Err(Error::load(format!(
            "{name} is truncated: the header describes {need} bytes but the file has {file_len}"
        )));
    }
    Ok(names)
}

/// The weight files of a checkpoint directory, in a stable order.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<BTreeMap<String, String>>)> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::load(format!("{} is not valid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::load(format!("{} has no `weight_map` object", index.display())))?;
        let mut wm = BTreeMap::new();
        for (k, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| Error::load(format!("{}: weight_map[{k}] is not a file name", index.display())))?;
            wm.insert(k.clone(), f.to_string());
        }
        let mut files: Vec<String> = wm.values().cloned().collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.exists() {
                return Err(Error::load(format!(
                    "shard {} named in model.safetensors.index.json does not exist",
                    p.display()
                )));
            }
        }
        return Ok((paths, Some(wm)));
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok((vec![single], None));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::load(format!("cannot read directory {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::load(format!("no .safetensors weight files in {}", dir.display())));
    }
    Ok((files, None))
}

impl TensorStore {
    /// Opens every weight file of `dir`. `cast` converts floating-point
    /// tensors to that dtype as they are taken.
    pub fn open(dir: &Path, cast: Option<Dtype>) -> Result<TensorStore> {
        let (files, index) = weight_files(dir)?;
        let mut tensors = HashMap::new();
        let mut origin: HashMap<String, String> = HashMap::new();
        for path in &files {
            validate_safetensors(path)?;
            let (arrays, _meta) = load_safetensors(path)?;
            let fname = path.file_name().unwrap().to_string_lossy().into_owned();
            for (name, a) in arrays {
                if let Some(prev) = origin.insert(name.clone(), fname.clone()) {
                    return Err(Error::load(format!("tensor `{name}` appears in both {prev} and {fname}")));
                }
                tensors.insert(name, a);
            }
        }
        if let Some(wm) = index {
            for (name, file) in &wm {
                match origin.get(name) {
                    None => {
                        return Err(Error::load(format!(
                            "model.safetensors.index.json maps `{name}` to {file}, but no shard holds it"
                        )))
                    }
                    Some(f) if f != file => {
                        return Err(Error::load(format!(
                            "model.safetensors.index.json maps `{name}` to {file}, but it is in {f}"
                        )))
                    }
                    _ => {}
                }
            }
        }
        Ok(TensorStore { tensors, taken: HashSet::new(), cast, files })
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The tensor as stored (no cast): for packed and integer tensors.
    pub fn raw(&mut self, name: &str) -> Result<Array> {
        let a = self
            .tensors
            .get(name)
            .cloned()
            .ok_or_else(|| Error::load(format!("checkpoint is missing tensor `{name}`")))?;
        self.taken.insert(name.to_string());
        Ok(a)
    }

    /// A floating-point tensor, cast if the store was opened with a cast.
    pub fn get(&mut self, name: &str) -> Result<Array> {
        let a = self.raw(name)?;
        match self.cast {
            Some(dt) if a.dtype().is_float() && a.dtype() != dt => a.astype(dt),
            _ => Ok(a),
        }
    }

    /// Like `get`, checking the shape.
    pub fn get_shaped(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let a = self.get(name)?;
        check_shape(name, &a, shape)?;
        Ok(a)
    }

    /// Like `raw`, checking the shape.
    pub fn raw_shaped(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let a = self.raw(name)?;
        check_shape(name, &a, shape)?;
        Ok(a)
    }

    /// Names that no part of the model asked for.
    pub fn unused(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().filter(|k| !self.taken.contains(*k)).cloned().collect();
        v.sort();
        v
    }
}

pub fn check_shape(name: &str, a: &Array, shape: &[i32]) -> Result<()> {
    let s = a.shape();
    if s != shape {
        return Err(Error::load(format!("tensor `{name}` has shape {s:?}, expected {shape:?}")));
    }
    Ok(())
}
