//! Properties checked by the fuzz targets; see `props.rs` (also compiled into the
//! stable proptest suite `crates/format/tests/parse_any.rs`).

pub mod props;
