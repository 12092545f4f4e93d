//! N-API glue: the only module that knows about Node.

mod info;
