//! TODO(dirent)
