//! Safe handle over the C++ compiled decode step (cpp/decode.cpp).

use super::array::{check, Array};
use super::ffi::{self, Handle};
use super::QuantSpec;
use crate::error::{Error, Result};
use std::ffi::CString;

pub use ffi::DecoderConfig;

pub struct DecoderHandle(ffi::DecoderPtr);

fn c(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("name {s:?} contains a NUL byte")))
}

impl DecoderHandle {
    pub fn new(cfg: &DecoderConfig, attn: &[bool], moe: &[bool]) -> Result<DecoderHandle> {
        let a: Vec<u8> = attn.iter().map(|&x| x as u8).collect();
        let m: Vec<u8> = moe.iter().map(|&x| x as u8).collect();
        let mut h: ffi::DecoderPtr = std::ptr::null_mut();
        check(unsafe { ffi::mlxb_decoder_new(cfg, a.as_ptr(), m.as_ptr(), &mut h) })?;
        Ok(DecoderHandle(h))
    }
    pub fn add_weight(&self, name: &str, a: &Array) -> Result<()> {
        let n = c(name)?;
        check(unsafe { ffi::mlxb_decoder_add_weight(self.0, n.as_ptr(), a.handle()) })
    }
    pub fn set_quant(&self, path: &str, q: QuantSpec) -> Result<()> {
        let p = c(path)?;
        let m = c(q.mode.name())?;
        check(unsafe { ffi::mlxb_decoder_set_quant(self.0, p.as_ptr(), m.as_ptr(), q.bits, q.group_size) })
    }
    pub fn finalize(&self) -> Result<()> {
        check(unsafe { ffi::mlxb_decoder_finalize(self.0) })
    }
    pub fn step(&self, compiled: bool, ins: &[&Array]) -> Result<Vec<Array>> {
        let hs: Vec<Handle> = ins.iter().map(|a| a.handle()).collect();
        let mut outs: Vec<Handle> = vec![std::ptr::null_mut(); ins.len() + 1];
        let mut n = 0usize;
        check(unsafe {
            ffi::mlxb_decoder_step(self.0, compiled as i32, hs.as_ptr(), hs.len(), outs.as_mut_ptr(), outs.len(), &mut n)
        })?;
        Ok(outs.into_iter().take(n).map(Array).collect())
    }
}

impl Drop for DecoderHandle {
    fn drop(&mut self) {
        unsafe { ffi::mlxb_decoder_free(self.0) }
    }
}
