//! Arguments as JS hands them over, checked in one place.
//!
//! Option objects and messages are read raw: napi's typed objects drop keys
//! they do not know, so `{ maxTokenz: 5 }` would run with the default
//! silently. Arguments of Promise-returning methods are converted here, not
//! by napi's generated glue, because a failed conversion there throws
//! synchronously before our code runs; here it rejects the promise.
//!
//! Errors that JS would raise as a `TypeError` (a value of the wrong kind,
//! an unknown key) or a `RangeError` (a number out of range) are built with
//! [`type_error`] / [`range_error`] and become those classes through
//! [`classed`], on the JS thread, where a JS error object can be made.

use napi::bindgen_prelude::*;

// The class travels in the message, the way JS's own `String(error)` shows
// it, because a napi::Error can cross threads and `?` only as a status and
// a string; `classed` strips it again when it builds the JS object.
const TYPE: &str = "TypeError: ";
const RANGE: &str = "RangeError: ";

/// An error to be raised as a JS `TypeError`.
pub(crate) fn type_error(msg: impl std::fmt::Display) -> napi::Error {
    napi::Error::new(Status::InvalidArg, format!("{TYPE}{msg}"))
}

/// An error to be raised as a JS `RangeError`.
pub(crate) fn range_error(msg: impl std::fmt::Display) -> napi::Error {
    napi::Error::new(Status::InvalidArg, format!("{RANGE}{msg}"))
}

/// `e` as the JS error it stands for: a `TypeError` or `RangeError` when
/// built by [`type_error`] / [`range_error`], else unchanged (a plain
/// `Error`). JS thread only. napi-rs rejects a promise (and throws) with the
/// JS object an error carries, so the class survives a deferred rejection.
pub(crate) fn classed(env: &Env, e: napi::Error) -> napi::Error {
    let (range, msg) = if let Some(m) = e.reason.strip_prefix(TYPE) {
        (false, m)
    } else if let Some(m) = e.reason.strip_prefix(RANGE) {
        (true, m)
    } else {
        return e;
    };
    let plain = napi::Error::new(e.status, msg.to_string());
    let value = if range {
        JsRangeError::from(plain).into_unknown(*env)
    } else {
        JsTypeError::from(plain).into_unknown(*env)
    };
    if value.raw().is_null() {
        return e; // the environment is going away; nothing will read it
    }
    napi::Error::from(value)
}

/// A promise already rejected with `e` (as its JS class): a
/// Promise-returning method reports bad arguments by rejecting, never by
/// throwing.
pub(crate) fn rejected<'e>(env: &'e Env, e: napi::Error) -> Result<Object<'e>> {
    let (deferred, promise) = env.create_deferred::<(), fn(Env) -> Result<()>>()?;
    deferred.reject(classed(env, e));
    Ok(promise)
}

/// Levenshtein distance over characters (keys are short).
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The valid key closest to `key`, if any is close enough to be what was
/// meant. Case and `_`/`-` are ignored first, so `max_tokens` finds
/// `maxTokens` (callers coming from Python or the OpenAI API).
pub(crate) fn closest<'a>(key: &str, valid: &[&'a str]) -> Option<&'a str> {
    let norm = |s: &str| s.chars().filter(|c| *c != '_' && *c != '-').flat_map(char::to_lowercase).collect::<String>();
    let k = norm(key);
    let (best, d) = valid.iter().map(|v| (*v, distance(&k, &norm(v)))).min_by_key(|&(_, d)| d)?;
    // About one edit in three characters: `maxTokenz`, `temprature`,
    // `stopp` are typos; `foo` is not a misspelt `seed`.
    (d <= 1 + k.chars().count() / 3).then_some(best)
}

/// The first own enumerable key of `obj` that is not in `valid`, with
/// the valid key it probably meant.
fn unknown_key<'a>(obj: &Object, valid: &[&'a str]) -> Result<Option<(String, Option<&'a str>)>> {
    Ok(Object::keys(obj)?.into_iter().find(|k| !valid.contains(&k.as_str())).map(|k| {
        let near = closest(&k, valid);
        (k, near)
    }))
}

/// "(did you mean `x`?)", or the valid keys when none is close.
fn suggestion(prefix: &str, near: Option<&str>, valid: &[&str]) -> String {
    match near {
        Some(n) => format!(" (did you mean `{prefix}{n}`?)"),
        None => format!("; valid: {}", valid.join(", ")),
    }
}

/// The JS type of `v` for messages ("a string", "an array", "null").
pub(crate) fn kind_of(v: &Unknown) -> String {
    if is_array(v) {
        return "an array".into();
    }
    match v.get_type() {
        Ok(ValueType::Object) => "an object".into(),
        Ok(ValueType::Undefined) => "undefined".into(),
        Ok(ValueType::Null) => "null".into(),
        Ok(t) => format!("a {}", t.to_string().to_lowercase()),
        Err(_) => "an unreadable value".into(),
    }
}

pub(crate) fn is_array(v: &Unknown) -> bool {
    let mut yes = false;
    // SAFETY: a live value of the current call's environment.
    let status = unsafe { napi::sys::napi_is_array(v.value().env, v.raw(), &mut yes) };
    status == napi::sys::Status::napi_ok && yes
}

fn is_nullish(v: &Unknown) -> bool {
    matches!(v.get_type(), Ok(ValueType::Undefined | ValueType::Null))
}

/// `v` converted to `T`; `name` and `expected` say what it should have been.
pub(crate) fn value<T: FromNapiValue>(v: &Unknown, name: &str, expected: &str) -> Result<T> {
    // SAFETY: a live value of the current call's environment.
    unsafe { T::from_napi_value(v.value().env, v.raw()) }
        .map_err(|_| type_error(format!("{name} must be {expected}, found {}", kind_of(v))))
}

/// An array of numbers (token ids, before they are checked to be ids);
/// an element of another kind is named by its index.
pub(crate) fn numbers(v: &Unknown, name: &str) -> Result<Vec<f64>> {
    if !is_array(v) {
        return Err(type_error(format!("{name} must be an array of token ids, found {}", kind_of(v))));
    }
    // SAFETY: checked to be an array of the current call's environment.
    let arr = unsafe { Array::from_napi_value(v.value().env, v.raw()) }?;
    (0..arr.len())
        .map(|i| {
            let x: Unknown = arr.get(i)?.ok_or_else(|| type_error(format!("{name}[{i}] is missing")))?;
            value(&x, &format!("{name}[{i}]"), "a token id (a number)")
        })
        .collect()
}

/// Whether `v` is a string.
pub(crate) fn is_string(v: &Unknown) -> bool {
    matches!(v.get_type(), Ok(ValueType::String))
}

/// An optional argument: undefined and null are `None`.
pub(crate) fn optional<T: FromNapiValue>(v: Option<Unknown>, name: &str, expected: &str) -> Result<Option<T>> {
    match v {
        Some(v) if !is_nullish(&v) => value(&v, name, expected).map(Some),
        _ => Ok(None),
    }
}

/// A plain object (not an array, not a function), or a TypeError.
fn object<'e>(v: &Unknown<'e>, name: &str) -> Result<Object<'e>> {
    if is_array(v) || v.get_type()? != ValueType::Object {
        return Err(type_error(format!("{name} must be an object, found {}", kind_of(v))));
    }
    // SAFETY: checked to be an object of the current call's environment.
    unsafe { Object::from_napi_value(v.value().env, v.raw()) }
}

/// An options object (undefined and null mean none) whose keys must all be
/// in `valid`, converted to `T`. `path` is where it sits: "" for a
/// method's own options, "defaults" for a session's default options
/// (`unknown option \`defaults.maxTokenz\``).
pub(crate) fn options<T: FromNapiValue>(v: Option<Unknown>, path: &str, valid: &[&str]) -> Result<Option<T>> {
    let Some(v) = v.filter(|v| !is_nullish(v)) else { return Ok(None) };
    let (name, prefix) = if path.is_empty() { ("options".to_string(), String::new()) } else { (path.to_string(), format!("{path}.")) };
    let obj = object(&v, &name)?;
    if let Some((key, near)) = unknown_key(&obj, valid)? {
        return Err(type_error(format!("unknown option `{prefix}{key}`{}", suggestion(&prefix, near, valid))));
    }
    // SAFETY: a live object of the current call's environment.
    unsafe { T::from_napi_value(v.value().env, v.raw()) }.map(Some).map_err(|e| field_error(&obj, &name, e))
}

/// napi's "Failed to convert napi value String into rust type `f64` on
/// GenerateOptions.maxTokens" as a TypeError in JS terms:
/// "options.maxTokens must be a number, found a string".
fn field_error(obj: &Object, name: &str, e: napi::Error) -> napi::Error {
    let Some((_, field)) = e.reason.rsplit_once(" on ").and_then(|(_, at)| at.split_once('.')) else {
        return type_error(format!("{name}: {}", e.reason));
    };
    let found = obj.get::<Unknown>(field).ok().flatten().map(|v| kind_of(&v)).unwrap_or_else(|| "undefined".into());
    let rust = e.reason.split_once("into rust type `").and_then(|(_, t)| t.split_once('`')).map(|(t, _)| t);
    let expected = match rust {
        Some("f64" | "f32" | "u32" | "i32" | "i64" | "u64") => "a number",
        Some("String") => "a string",
        Some("bool") => "a boolean",
        _ => return type_error(format!("{name}.{field} has the wrong type: {found} ({})", e.reason)),
    };
    type_error(format!("{name}.{field} must be {expected}, found {found}"))
}

/// A message object with only the keys a message has.
pub(crate) fn message<T: FromNapiValue>(v: &Unknown, name: &str, valid: &[&str]) -> Result<T> {
    let obj = object(v, name)?;
    if let Some((key, near)) = unknown_key(&obj, valid)? {
        return Err(type_error(format!("unknown field `{key}` in {name}{}", suggestion("", near, valid))));
    }
    // SAFETY: a live object of the current call's environment.
    unsafe { T::from_napi_value(v.value().env, v.raw()) }.map_err(|e| field_error(&obj, name, e))
}

/// An array of messages (see [`message`]).
pub(crate) fn messages<T: FromNapiValue>(v: &Unknown, name: &str, valid: &[&str]) -> Result<Vec<T>> {
    if !is_array(v) {
        return Err(type_error(format!("{name} must be an array of messages, found {}", kind_of(v))));
    }
    // SAFETY: checked to be an array of the current call's environment.
    let arr = unsafe { Array::from_napi_value(v.value().env, v.raw()) }?;
    (0..arr.len())
        .map(|i| {
            let m: Unknown = arr.get(i)?.ok_or_else(|| type_error(format!("{name}[{i}] is missing")))?;
            message(&m, &format!("{name}[{i}]"), valid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: [&str; 5] = ["maxTokens", "temperature", "topK", "stop", "seed"];

    #[test]
    fn closest_finds_typos_and_other_spellings() {
        assert_eq!(distance("maxTokenz", "maxTokens"), 1);
        assert_eq!(distance("", "abc"), 3);
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(closest("maxTokenz", &KEYS), Some("maxTokens"));
        assert_eq!(closest("max_tokens", &KEYS), Some("maxTokens"));
        assert_eq!(closest("temprature", &KEYS), Some("temperature"));
        assert_eq!(closest("top_k", &KEYS), Some("topK"));
        assert_eq!(closest("stopp", &KEYS), Some("stop"));
        // Nothing near: no guess.
        assert_eq!(closest("foo", &KEYS), None);
        assert_eq!(closest("signal", &KEYS), None);
        assert_eq!(closest("x", &[]), None);
    }
}
