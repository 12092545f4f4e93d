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
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    let mut names = Vec::new();
    for (tname, info) in obj {
        if tname == "__metadata__" {
            continue;
        }
        let bad = |what: String| Error::load(format!("{name}: tensor `{tname}` {what}"));
        let dt = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let size = st_dtype_size(dt).ok_or_else(|| bad(format!("has unsupported dtype {dt}")))?;
        let dims = info.get("shape").and_then(Value::as_array).ok_or_else(|| bad("has no shape".into()))?;
        if dims.len() > 16 {
            return Err(bad(format!("has {} dimensions", dims.len())));
        }
        let mut shape: Vec<u64> = Vec::with_capacity(dims.len());
        for d in dims {
            // MLX dimensions are int32: a negative, fractional or larger one
            // is refused here, by name, not by MLX.
            match d.as_u64().filter(|&x| x <= i32::MAX as u64) {
                Some(x) => shape.push(x),
                None => return Err(bad(format!("has dimension {d}, not an integer in 0..={}", i32::MAX))),
            }
        }
        let offs = info.get("data_offsets").and_then(Value::as_array).ok_or_else(|| bad("has no data_offsets".into()))?;
        let offs: Vec<u64> = match offs.as_slice() {
            [a, b] => match (a.as_u64(), b.as_u64()) {
                (Some(a), Some(b)) => vec![a, b],
                _ => return Err(bad(format!("has data_offsets {offs:?}, not two byte offsets"))),
            },
            _ => return Err(bad(format!("has data_offsets {offs:?}, not two byte offsets"))),
        };
        let want = shape
            .iter()
            .try_fold(size as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("of shape {shape:?} {dt} is larger than any file")))?;
        if offs[1] < offs[0] || offs[1] - offs[0] != want {
            return Err(bad(format!(
                "of shape {shape:?} {dt} needs {want} bytes but its offsets span {}",
                offs[1].saturating_sub(offs[0])
            )));
        }
        spans.push((offs[0], offs[1], tname.as_str()));
        names.push(tname.clone());
    }
    // Tensors may not share bytes: one tensor's data read as another's
    // would be a wrong model, not an error.
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::load(format!(
                "{name}: tensors `{}` and `{}` overlap (bytes {}..{} and {}..{})",
                w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }
    let data_end = spans.iter().map(|s| s.1).max().unwrap_or(0);
    let need = (8 + n).checked_add(data_end);
    if need.is_none_or(|need| file_len < need) {
        return Err(Error::load(format!(
            "{name} is truncated: the header describes {} bytes but the file has {file_len}",
            need.map(|x| x.to_string()).unwrap_or_else(|| "more than 2^64".into())
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
            // A shard is a file inside the checkpoint folder: no absolute
            // paths, no `..`, checked before any file is opened.
            let inside = !f.is_empty()
                && Path::new(f).components().all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(Error::load(format!(
                    "{}: weight_map[{k}] names {f:?}, which is not a file inside the checkpoint folder",
                    index.display()
                )));
            }
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

    /// A floating-point tensor (weights, norms, biases), cast if the store
    /// was opened with a cast. Any other dtype is refused: an integer
    /// embedding would load and generate nonsense without a word.
    pub fn get(&mut self, name: &str) -> Result<Array> {
        let a = self.raw(name)?;
        if !a.dtype().is_float() {
            return Err(Error::load(format!(
                "tensor `{name}` has dtype {}; a floating-point tensor (float16, bfloat16 or float32) is expected",
                a.dtype()
            )));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, FixtureSpec, Preset};
    use serde_json::json;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mlxlfm-weights-{}-{name}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A safetensors file with this header and `data` bytes after it.
    fn file(dir: &Path, header: Value, data: usize) -> PathBuf {
        let h = serde_json::to_vec(&header).unwrap();
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h);
        bytes.extend(vec![0u8; data]);
        let p = dir.join("model.safetensors");
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn err(dir: &Path, header: Value, data: usize) -> String {
        validate_safetensors(&file(dir, header, data)).unwrap_err().message
    }

    #[test]
    fn hostile_headers_are_refused_by_name() {
        let d = tmp("headers");
        let ok = json!({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}});
        assert_eq!(validate_safetensors(&file(&d, ok, 16)).unwrap(), vec!["a".to_string()]);
        // Offsets near 2^64: the span is right, the end wraps past the file check.
        let top = u64::MAX - 15;
        let e = err(&d, json!({"a": {"dtype": "U8", "shape": [15], "data_offsets": [top, top + 15]}}), 16);
        assert!(e.contains("is truncated") && e.contains("more than 2^64"), "{e}");
        // A byte count that wraps u64.
        let big = i32::MAX;
        let e = err(&d, json!({"a": {"dtype": "F64", "shape": [big, big, big, 8], "data_offsets": [0, 8]}}), 8);
        assert!(e.contains("tensor `a`") && e.contains("larger than any file"), "{e}");
        // Negative and fractional dimensions.
        let e = err(&d, json!({"a": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}), 16);
        assert!(e.contains("tensor `a` has dimension -1"), "{e}");
        let e = err(&d, json!({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]}}), 16);
        assert!(e.contains("has dimension 2.5"), "{e}");
        // Two tensors over the same bytes.
        let e = err(
            &d,
            json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
            12,
        );
        assert!(e.contains("tensors `a` and `b` overlap"), "{e}");
        let e = err(&d, json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}), 8);
        assert!(e.contains("not two byte offsets"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_shard_outside_the_folder_is_refused_before_any_file_is_opened() {
        let d = tmp("escape");
        for bad in ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors", ""] {
            let index = json!({"weight_map": {"model.embed_tokens.weight": bad}});
            std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
            let e = TensorStore::open(&d, None).err().expect("escaping shard accepted").message;
            assert!(e.contains("not a file inside the checkpoint folder"), "{bad}: {e}");
        }
        std::fs::remove_dir_all(&d).ok();
    }

    /// An integer tensor where the model needs floats (the embedding) is an
    /// error naming it, not a model that emits one token forever.
    #[test]
    fn a_tensor_of_the_wrong_dtype_for_its_role_is_refused() {
        let d = tmp("role");
        fixture::generate(&FixtureSpec::new(Preset::Tiny), &d).unwrap();
        let path = d.join("model.safetensors");
        let (arrays, _) = load_safetensors(&path).unwrap();
        let arrays: Vec<(String, Array)> = arrays
            .into_iter()
            .map(|(n, a)| if n == "model.embed_tokens.weight" { (n, a.astype(Dtype::Int32).unwrap()) } else { (n, a) })
            .collect();
        save_safetensors_for_test(&path, &arrays);
        let e = crate::model::load_model(&d, &Default::default()).err().expect("an int32 embedding loaded").message;
        assert!(e.contains("`model.embed_tokens.weight` has dtype int32"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }

    fn save_safetensors_for_test(path: &Path, arrays: &[(String, Array)]) {
        crate::mlx::save_safetensors(path, arrays, &[]).unwrap();
    }
}
