//! The journal's on-disk format ([`record`]), the order of a batch's writes
//! ([`append`]), the writer's decisions around them: syncs, compaction,
//! identity ([`writer`]) and what a start decides about a log it finds
//! ([`recovery`]); a lease's state as the etcd journal keeps it, and how
//! each change updates it ([`stored`]).

pub mod append;
pub mod record;
pub mod recovery;
pub mod stored;
pub mod writer;
