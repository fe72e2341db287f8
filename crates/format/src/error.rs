//! Typed parse errors. Every error names the on-disk structure and the block it was
//! read from, so that a message such as "extent tree block at block 1234: bad magic"
//! can be acted on with debugfs.

/// Result alias for the format layer.
pub type Result<T> = std::result::Result<T, FormatError>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("{structure} at block {block}: bad magic {found:#x}")]
    BadMagic {
        structure: &'static str,
        block: u64,
        found: u32,
    },
    #[error("{structure} at block {block}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadChecksum {
        structure: &'static str,
        block: u64,
        stored: u32,
        computed: u32,
    },
    #[error("{structure} at block {block}: {reason}")]
    Corrupt {
        structure: &'static str,
        block: u64,
        reason: String,
    },
}

impl FormatError {
    /// Shorthand for [`FormatError::Corrupt`].
    pub fn corrupt(structure: &'static str, block: u64, reason: impl Into<String>) -> Self {
        FormatError::Corrupt {
            structure,
            block,
            reason: reason.into(),
        }
    }
}
