//! The crate's error type. Engine errors carry a kind (so the JS glue can
//! pick a message prefix and tests can match on it) and a message that names
//! the problem: which tensor, which field, which value.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// An exception raised inside MLX; the message is MLX's own.
    Mlx,
    /// A checkpoint that cannot be loaded: missing/misshapen tensor, bad file.
    Load,
    /// A bad config.json / generation_config.json value.
    Config,
    /// Bad arguments from the caller (options, token ids, messages).
    InvalidArgument,
    /// Tokenizer or chat-template failures.
    Text,
    Io,
    /// The model's worker has shut down.
    Closed,
}

#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }
    pub fn mlx(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Mlx, m)
    }
    pub fn load(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Load, m)
    }
    pub fn config(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, m)
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, m)
    }
    pub fn text(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Text, m)
    }
    /// Prefixes the message with where the error happened.
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.message = format!("{ctx}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = match self.kind {
            ErrorKind::Mlx => "MLX error",
            ErrorKind::Load => "load error",
            ErrorKind::Config => "config error",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Text => "text error",
            ErrorKind::Io => "I/O error",
            ErrorKind::Closed => "model closed",
        };
        write!(f, "{prefix}: {}", self.message)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::new(ErrorKind::Io, e.to_string())
    }
}

/// Early-return with an InvalidArgument/Config/... error built by format!.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::ErrorKind::$kind, format!($($arg)*)))
    };
}
