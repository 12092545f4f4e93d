//! A lone sequence's decode position, as the step's input, without a host
//! array per token.
//!
//! MLX 0.32.4's CUDA allocator keeps every array made from host data, and
//! every array of at most 8 bytes, in managed memory (a small pool of pages
//! the GPU maps but does not own): the int32 scalar the host made each token
//! lived there, and every kernel that read it (each attention layer's q/k/v
//! kernel, its two K/V scatters and its attention kernel: 24 launches a
//! 1.2B or 8B-A1B step) paid a read across the bus, ~1.6 µs a launch in
//! session 26's kernel-bench (`scalar-host-fresh` against
//! `scalar-device16`). Here the positions `0..n` are one int32 array that a
//! GPU op wrote (device memory, more than 8 bytes), made once and grown by
//! doubling; a step's position is a slice of it, which MLX evaluates as a
//! view of the same buffer (no kernel, no copy, no host write). The same
//! code runs on every backend: on the CPU and on Metal's unified memory the
//! view costs what the scalar did.
//!
//! `MLX_LFM_POSITION_TABLE=0` makes the host scalar again (an A/B's off
//! arm).

use crate::error::{Error, Result};
use crate::mlx::{arange, Array, Dtype};
use std::cell::RefCell;

/// The table's first length: a step's position up to this needs no growth.
const FIRST: usize = 4096;

fn wanted() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_POSITION_TABLE", &ON, |v| v != Some("0"))
}

/// The positions of one model's lone-sequence steps. Not Send, like the
/// compiled step it belongs to.
#[derive(Default)]
pub(crate) struct Positions {
    table: RefCell<Option<Array>>,
}

impl Positions {
    /// `pos` as an int32 scalar: a view of the table (or, with the table
    /// switched off, a scalar made from the host value).
    pub(crate) fn at(&self, pos: usize) -> Result<Array> {
        let p = i32::try_from(pos).map_err(|_| Error::invalid(format!("decode position {pos} exceeds int32")))?;
        if !wanted() {
            return Array::scalar(p as f64, Dtype::Int32);
        }
        let mut t = self.table.borrow_mut();
        if t.as_ref().is_none_or(|x| pos >= x.size()) {
            *t = Some(grown(t.as_ref().map(|x| x.size()), pos)?);
        }
        t.as_ref().expect("made above").slice_axis(0, p, p + 1)?.reshape(&[])
    }

    /// Positions held now (0: none made yet).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.borrow().as_ref().map(|t| t.size()).unwrap_or(0)
    }
}

/// A table long enough to hold `pos`: twice the old length (`had`), or
/// more, from [`FIRST`]. The old one stays alive as long as a step still
/// holds a view of it.
fn grown(had: Option<usize>, pos: usize) -> Result<Array> {
    let mut n = had.map(|x| x * 2).unwrap_or(FIRST).max(FIRST);
    while n <= pos {
        n = n.checked_mul(2).ok_or_else(|| Error::invalid(format!("decode position {pos} is out of range")))?;
    }
    let n = i32::try_from(n).map_err(|_| Error::invalid(format!("decode position {pos}: its table would pass int32's range")))?;
    // Lazy: the first step that reads it runs arange on its stream, and
    // the GPU's own output is what lands in device memory.
    arange(0.0, n as f64, 1.0, Dtype::Int32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_is_its_value_and_the_table_grows_by_doubling() {
        let p = Positions::default();
        assert_eq!(p.len(), 0);
        for pos in [0usize, 1, 17, 4095] {
            let a = p.at(pos).unwrap();
            assert_eq!(a.ndim(), 0, "position {pos} is not a scalar");
            assert_eq!(a.dtype(), Dtype::Int32);
            assert_eq!(a.item::<i32>().unwrap(), pos as i32);
        }
        assert_eq!(p.len(), FIRST);
        // A view taken before the table grew keeps its value after.
        let before = p.at(4000).unwrap();
        let a = p.at(4096).unwrap();
        assert_eq!(p.len(), 2 * FIRST);
        assert_eq!(a.item::<i32>().unwrap(), 4096);
        assert_eq!(before.item::<i32>().unwrap(), 4000);
        let far = p.at(40_000).unwrap();
        assert_eq!(p.len(), 65_536);
        assert_eq!(far.item::<i32>().unwrap(), 40_000);
        assert!(p.at(i32::MAX as usize + 1).is_err());
    }

    #[test]
    fn the_host_scalar_when_the_table_is_off() {
        let p = Positions::default();
        let a = crate::knobs::with_overrides(&[("MLX_LFM_POSITION_TABLE".to_string(), Some("0".to_string()))], || p.at(9).unwrap());
        assert_eq!(a.item::<i32>().unwrap(), 9);
        assert_eq!(p.len(), 0, "the table was made with it switched off");
    }
}
