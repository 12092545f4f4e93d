//! N-API glue: the only module that knows about Node.

mod convert;
mod fixture;
mod info;
mod model;
