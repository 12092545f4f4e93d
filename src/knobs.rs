//! The `MLX_LFM_*` switches read from the environment, with per-thread
//! overrides: so one process can hold engines built under different
//! switches and time them against each other in alternation
//! (`mlx-lfm-bench --ab`), where separate processes minutes apart measured
//! the lent machine's host drifting by up to 2x within one call (session 13,
//! `bench/results/2026-12-03-h200-session13.raw.jsonl`), not the switch.
//!
//! A switch's site keeps its environment value in a `OnceLock` (read once:
//! some are asked per op while a graph is built); an override set on this
//! thread is looked up first, and only when one is set, so the usual path
//! costs one empty-vector check.

use std::cell::RefCell;
use std::sync::OnceLock;

/// Switches by name, each with its value (`None`: unset).
pub type Overrides = Vec<(String, Option<String>)>;

thread_local! {
    static OVERRIDES: RefCell<Overrides> = const { RefCell::new(Vec::new()) };
}

/// This thread's override of `name`: `Some(None)` when it is overridden as
/// unset, `None` when it is not overridden.
pub fn overridden(name: &str) -> Option<Option<String>> {
    OVERRIDES.with(|o| {
        let o = o.borrow();
        if o.is_empty() {
            return None;
        }
        o.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    })
}

/// `name`'s value: this thread's override, else the environment (read now).
pub fn var(name: &str) -> Option<String> {
    overridden(name).unwrap_or_else(|| std::env::var(name).ok())
}

/// `name` parsed by `parse`: from this thread's override, else from the
/// environment as first read into `cell`.
pub fn cached<T: Clone>(name: &str, cell: &OnceLock<T>, parse: impl Fn(Option<&str>) -> T) -> T {
    match overridden(name) {
        Some(v) => parse(v.as_deref()),
        None => cell.get_or_init(|| parse(std::env::var(name).ok().as_deref())).clone(),
    }
}

/// Runs `f` with `vars` set (`None`: unset) on this thread, over the
/// environment and any outer override; restored after, also on a panic.
pub fn with_overrides<R>(vars: &[(String, Option<String>)], f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDES.with(|o| o.borrow_mut().truncate(self.0));
        }
    }
    let _restore = Restore(OVERRIDES.with(|o| {
        let mut o = o.borrow_mut();
        let before = o.len();
        o.extend(vars.iter().cloned());
        before
    }));
    f()
}

/// `NAME=VALUE` pairs separated by commas (`NAME=` or `NAME=unset`: unset).
pub fn parse_assignments(s: &str) -> crate::Result<Overrides> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').ok_or_else(|| crate::Error::invalid(format!("{p:?}: expected NAME=VALUE")))?;
            let k = k.trim();
            if !k.starts_with("MLX_LFM_") {
                return Err(crate::Error::invalid(format!(
                    "{k}: only MLX_LFM_* switches can be set per engine (MLX's own are read once per process)"
                )));
            }
            let v = v.trim();
            Ok((k.to_string(), (!v.is_empty() && v != "unset").then(|| v.to_string())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_hold_on_this_thread_only_and_are_restored() {
        static CELL: OnceLock<bool> = OnceLock::new();
        let name = "MLX_LFM_KNOBS_TEST_SWITCH";
        let on = |v: Option<&str>| v == Some("1");
        assert!(!cached(name, &CELL, on));
        let vars = parse_assignments(&format!("{name}=1")).unwrap();
        with_overrides(&vars, || {
            assert!(cached(name, &CELL, on));
            assert_eq!(var(name).as_deref(), Some("1"));
            // Nested: the inner one wins, then the outer is back.
            with_overrides(&[(name.to_string(), None)], || assert!(!cached(name, &CELL, on)));
            assert!(cached(name, &CELL, on));
            let other = std::thread::spawn(move || cached(name, &CELL, on)).join().unwrap();
            assert!(!other, "another thread saw this thread's override");
        });
        assert!(!cached(name, &CELL, on));
        assert_eq!(overridden(name), None);
        let caught = std::panic::catch_unwind(|| with_overrides(&vars, || panic!("inside")));
        assert!(caught.is_err());
        assert_eq!(overridden(name), None, "an override outlived a panic");
    }

    #[test]
    fn assignments_name_what_is_wrong() {
        let v = parse_assignments("MLX_LFM_A=1, MLX_LFM_B=,MLX_LFM_C=unset").unwrap();
        assert_eq!(v, vec![("MLX_LFM_A".into(), Some("1".into())), ("MLX_LFM_B".into(), None), ("MLX_LFM_C".into(), None)]);
        assert!(parse_assignments("MLX_LFM_A").unwrap_err().message.contains("NAME=VALUE"));
        assert!(parse_assignments("MLX_MAX_OPS_PER_BUFFER=64").unwrap_err().message.contains("MLX_MAX_OPS_PER_BUFFER"));
    }
}
