//! Journal layer (see lib docs).
