//! TODO(dx)
