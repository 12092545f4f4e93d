//! N-API glue: the only module that knows about Node.

mod args;
mod convert;
mod converter;
mod fixture;
mod info;
mod model;
mod progress;
mod session;
mod stream;
mod tools;
