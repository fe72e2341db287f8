//! Tests of directory operations.
