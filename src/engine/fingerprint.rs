//! The model fingerprint: what a saved session or a prefix block on disk
//! must match before its K/V and conv states may be used by this model.
//!
//! Parts, each a SHA-256 (named, so a mismatch can say which part differs):
//! - `config`: config.json as stored;
//! - `weights`: every weight file's name, size and safetensors header (the
//!   tensor names, dtypes, shapes and offsets). Hashing the weight bytes
//!   themselves would read the whole checkpoint at every load (many GB for
//!   large models); a header plus size changes whenever a tensor is added,
//!   reshaped, retyped or the file rewritten with other lengths, which
//!   covers conversions and quantizations. A same-size in-place edit of the
//!   bytes is not seen (a fine-tune saved over the same file would be).
//! - `tokenizer`: tokenizer.json and tokenizer_config.json;
//! - `template`: the chat template in use;
//! - `cache`: the compute dtype and the KV cache kind (paged with its block
//!   size, flat, or the quantized kvCache), which decide what the saved
//!   tensors hold.

use crate::error::Result;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// SHA-256 over the parts, hex.
    pub hash: String,
    /// `(name, hex SHA-256)` in a fixed order.
    pub parts: Vec<(String, String)>,
    /// The cache part in words (for error messages).
    pub cache: String,
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file's bytes into `h`, length-prefixed (absent: a marker).
fn file_into(h: &mut Sha256, path: &Path) -> Result<()> {
    match std::fs::read(path) {
        Ok(b) => {
            h.update((b.len() as u64).to_le_bytes());
            h.update(&b);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.update(b"absent"),
        Err(e) => return Err(crate::error::Error::load(format!("cannot read {}: {e}", path.display()))),
    }
    Ok(())
}

/// A safetensors file's identity: name, size and header bytes.
fn weight_file_into(h: &mut Sha256, path: &Path) -> Result<()> {
    let err = |e: std::io::Error| crate::error::Error::load(format!("cannot read {}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(err)?;
    let size = f.metadata().map_err(err)?.len();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    h.update((name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update(size.to_le_bytes());
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8).map_err(err)?;
    // The loader has already validated the header; bound it anyway.
    let n = u64::from_le_bytes(n8).min(size.saturating_sub(8)).min(100 << 20);
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(err)?;
    h.update(n8);
    h.update(&header);
    Ok(())
}

impl Fingerprint {
    pub fn compute(dir: &Path, weight_files: &[PathBuf], template: Option<&str>, cache: String) -> Result<Fingerprint> {
        let mut parts = vec![];
        let mut part = |name: &str, f: &mut dyn FnMut(&mut Sha256) -> Result<()>| -> Result<()> {
            let mut h = Sha256::new();
            f(&mut h)?;
            parts.push((name.to_string(), hex(&h.finalize())));
            Ok(())
        };
        part("config", &mut |h| file_into(h, &dir.join("config.json")))?;
        let mut files: Vec<&PathBuf> = weight_files.iter().collect();
        files.sort_by_key(|p| p.file_name().map(|n| n.to_os_string()));
        part("weights", &mut |h| files.iter().try_for_each(|p| weight_file_into(h, p)))?;
        part("tokenizer", &mut |h| {
            file_into(h, &dir.join("tokenizer.json"))?;
            file_into(h, &dir.join("tokenizer_config.json"))
        })?;
        part("template", &mut |h| {
            match template {
                Some(t) => {
                    h.update(b"some");
                    h.update(t.as_bytes());
                }
                None => h.update(b"none"),
            }
            Ok(())
        })?;
        part("cache", &mut |h| {
            h.update(cache.as_bytes());
            Ok(())
        })?;
        let mut h = Sha256::new();
        for (n, v) in &parts {
            h.update(n.as_bytes());
            h.update(b"=");
            h.update(v.as_bytes());
            h.update(b"\n");
        }
        Ok(Fingerprint { hash: hex(&h.finalize()), parts, cache })
    }

    /// The first 8 bytes of the hash, as the paged pool's salt.
    pub fn salt(&self) -> u64 {
        u64::from_str_radix(&self.hash[..16], 16).unwrap_or(0)
    }

    /// Why a file stamped with `hash` and `parts` cannot be used here, or
    /// None when it matches.
    pub fn mismatch(&self, hash: &str, parts: &[(String, String)], their_cache: &str) -> Option<String> {
        if hash == self.hash {
            return None;
        }
        let differ: Vec<&str> = self
            .parts
            .iter()
            .filter(|(n, v)| parts.iter().find(|(m, _)| m == n).map(|(_, w)| w != v).unwrap_or(true))
            .map(|(n, _)| n.as_str())
            .collect();
        let mut why = format!("it was saved by another model: its {} differ", if differ.is_empty() { "fingerprints".to_string() } else { differ.join(", ") });
        if differ.contains(&"cache") {
            why.push_str(&format!(" (the file's cache is {their_cache}, this model's {})", self.cache));
        }
        Some(why)
    }
}

/// SHA-256 of `bytes`, hex (checksums of saved tensors).
pub fn sha256_hex(chunks: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for c in chunks {
        h.update(c);
    }
    hex(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(config: &str, cache: &str) -> Fingerprint {
        let dir = std::env::temp_dir().join(format!("mlx-lfm-fp-{}-{config}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        let f = Fingerprint::compute(&dir, &[], Some("t"), cache.into()).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        f
    }

    #[test]
    fn mismatch_names_the_parts_that_differ() {
        let a = fp("{\"a\":1}", "float32 flat");
        assert_eq!(a, fp("{\"a\":1}", "float32 flat"));
        assert_eq!(a.mismatch(&a.hash, &a.parts, &a.cache), None);
        let b = fp("{\"a\":2}", "float32 paged, 32-token blocks");
        let why = a.mismatch(&b.hash, &b.parts, &b.cache).unwrap();
        assert!(why.contains("its config, cache differ"), "{why}");
        assert!(why.contains("the file's cache is float32 paged, 32-token blocks, this model's float32 flat"), "{why}");
        assert_ne!(a.salt(), b.salt());
    }
}
