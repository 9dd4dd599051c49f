//! The journal's on-disk format ([`record`]), the order of a batch's writes
//! ([`append`]) and what a start decides about a log it finds
//! ([`recovery`]).

pub mod append;
pub mod record;
pub mod recovery;
