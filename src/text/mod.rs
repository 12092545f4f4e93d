//! Tokenizer, chat template and incremental detokenization (being written).
