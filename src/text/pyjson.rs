//! JSON text the way Python's `json.dumps` writes it, for the chat template's
//! `tojson` filter.
//!
//! Hugging Face renders chat templates with its own `tojson`:
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
//! sort_keys=sort_keys)`. minijinja's built-in filter differs in ways that
//! change prompts (compact `,`/`:` separators, HTML-escaping of `<>&'`), so
//! this module reproduces Python's output: `", "` / `": "` separators without
//! indent, `","` / `": "` with indent, insertion-ordered keys, Python float
//! repr (`1.0`, `1e+20`), only `"`, `\` and control characters escaped.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write as _;

/// Options mirroring `json.dumps` keyword arguments.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: newline plus `s` repeated per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

impl DumpOptions {
    /// Python's defaults for a given indent: `(", ", ": ")` on one line,
    /// `(",", ": ")` when indenting.
    pub fn with_indent(indent: Option<String>) -> Self {
        let item = if indent.is_some() { "," } else { ", " };
        DumpOptions {
            indent,
            item_separator: item.into(),
            ..Default::default()
        }
    }
}

/// Serializes `value` like `json.dumps`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0, 0)?;
    Ok(out)
}

const MAX_DEPTH: usize = 512;

fn not_serializable(value: &Value) -> Error {
    let kind = match value.kind() {
        ValueKind::Undefined => "Undefined".to_string(),
        other => other.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: object of type {kind} is not JSON serializable"),
    )
}

fn write_value(
    out: &mut String,
    value: &Value,
    opts: &DumpOptions,
    level: usize,
    depth: usize,
) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value is nested too deeply (circular reference?)",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_array(out, &items, opts, level, depth)?;
        }
        ValueKind::Map => write_object(out, value, opts, level, depth)?,
        ValueKind::Undefined | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(not_serializable(value));
        }
        // ValueKind is non-exhaustive.
        #[allow(unreachable_patterns)]
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn newline_indent(out: &mut String, indent: &str, level: usize) {
    out.push('\n');
    for _ in 0..level {
        out.push_str(indent);
    }
}

fn write_array(
    out: &mut String,
    items: &[Value],
    opts: &DumpOptions,
    level: usize,
    depth: usize,
) -> Result<(), Error> {
    if items.is_empty() {
        out.push_str("[]");
        return Ok(());
    }
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(ind) = &opts.indent {
            newline_indent(out, ind, level + 1);
        }
        write_value(out, item, opts, level + 1, depth + 1)?;
    }
    if let Some(ind) = &opts.indent {
        newline_indent(out, ind, level);
    }
    out.push(']');
    Ok(())
}

/// Python converts dict keys to strings: str as is, int/float via repr,
/// True/False/None as JSON literals; anything else is a TypeError.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn write_object(
    out: &mut String,
    value: &Value,
    opts: &DumpOptions,
    level: usize,
    depth: usize,
) -> Result<(), Error> {
    let mut entries = Vec::new();
    for key in value.try_iter()? {
        let item = value.get_item(&key)?;
        entries.push((key_string(&key)?, item));
    }
    if opts.sort_keys {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
    }
    if entries.is_empty() {
        out.push_str("{}");
        return Ok(());
    }
    out.push('{');
    for (i, (key, item)) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(ind) = &opts.indent {
            newline_indent(out, ind, level + 1);
        }
        write_string(out, key, opts.ensure_ascii);
        out.push_str(&opts.key_separator);
        write_value(out, item, opts, level + 1, depth + 1)?;
    }
    if let Some(ind) = &opts.indent {
        newline_indent(out, ind, level);
    }
    out.push('}');
    Ok(())
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        // Display of an integer value prints its digits (i64/u64/i128/u128).
        let _ = write!(out, "{value}");
    } else {
        let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        out.push_str(&py_float_repr(f));
    }
}

/// Python's `float.__repr__` (as used by `json.dumps`): the shortest digits
/// that round-trip, positional notation for exponents in [-4, 16), scientific
/// (`1e+16`, `1.5e-05`) otherwise, and a trailing `.0` on integral values.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp < 0 {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        } else if exp + 1 >= n {
            format!("{}{}.0", digits, "0".repeat((exp + 1 - n) as usize))
        } else {
            let (int_part, frac) = digits.split_at((exp + 1) as usize);
            format!("{int_part}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456.789, "123456.789"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1.2345e20, "1.2345e+20"),
            (f64::INFINITY, "Infinity"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "repr of {f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v = Value::from_serialize(serde_json::json!({
            "b": [1, 2.0, true, null],
            "a": "<x> & 'y' \"z\" é\n",
            "c": {}
        }));
        let s = dumps(&v, &DumpOptions::default()).unwrap();
        assert_eq!(
            s,
            r#"{"b": [1, 2.0, true, null], "a": "<x> & 'y' \"z\" é\n", "c": {}}"#
        );

        let mut o = DumpOptions::with_indent(Some("  ".into()));
        o.sort_keys = true;
        let s = dumps(&v, &o).unwrap();
        assert_eq!(
            s,
            "{\n  \"a\": \"<x> & 'y' \\\"z\\\" é\\n\",\n  \"b\": [\n    1,\n    2.0,\n    true,\n    null\n  ],\n  \"c\": {}\n}"
        );

        let o = DumpOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(
            dumps(&Value::from("é😀"), &o).unwrap(),
            r#""\u00e9\ud83d\ude00""#
        );
    }
}
