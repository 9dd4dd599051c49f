//! The journal's on-disk format ([`record`]).

pub mod record;
