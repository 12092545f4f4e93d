//! N-API glue: the only module that knows about Node.

// Under `cargo test` napi-derive leaves out the module registration
// (`#[cfg(not(test))]`), the only user of the exported functions and of the
// objects only they build, so the test build would warn that they are dead.
#![cfg_attr(test, allow(dead_code))]

mod args;
mod convert;
mod converter;
mod exec;
mod fixture;
mod info;
mod model;
mod progress;
mod session;
mod stream;
mod tools;
