//! A disk that keeps only what was synced: each file is held twice, as
//! programs see it and as it would be after a power cut, with the changes
//! made since the last sync kept in order. A kill of the process keeps
//! them (the page cache survives it); a power cut keeps any subset of them
//! (nothing orders the writes of one sync), and may tear one that it keeps.

/// A change to a file since its last sync (also what the power-cut tests'
/// FUSE file system keeps, `tests/support/lazyfs.rs`).
#[derive(Clone, Debug)]
pub enum Change {
    Write { offset: u64, bytes: Vec<u8> },
    Truncate(u64),
}

impl Change {
    /// The change made to `data`.
    pub fn apply(&self, data: &mut Vec<u8>) {
        match self {
            Change::Write { offset, bytes } => {
                let at = *offset as usize;
                if data.len() < at + bytes.len() {
                    data.resize(at + bytes.len(), 0);
                }
                data[at..at + bytes.len()].copy_from_slice(bytes);
            }
            Change::Truncate(len) => data.resize(*len as usize, 0),
        }
    }
}

/// One file.
#[derive(Clone, Debug, Default)]
pub struct File {
    durable: Vec<u8>,
    visible: Vec<u8>,
    pending: Vec<Change>,
}

/// What a power cut did to a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cut {
    pub pending: usize,
    pub kept: usize,
    pub torn: bool,
}

impl File {
    /// The file as programs see it.
    pub fn bytes(&self) -> &[u8] {
        &self.visible
    }

    /// The file as it is on the disk.
    pub fn durable(&self) -> &[u8] {
        &self.durable
    }

    pub fn len(&self) -> u64 {
        self.visible.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.visible.is_empty()
    }

    fn change(&mut self, change: Change) {
        change.apply(&mut self.visible);
        self.pending.push(change);
    }

    pub fn write(&mut self, offset: u64, bytes: &[u8]) {
        self.change(Change::Write {
            offset,
            bytes: bytes.to_vec(),
        });
    }

    pub fn set_len(&mut self, len: u64) {
        self.change(Change::Truncate(len));
    }

    /// `fsync`: everything written so far is durable.
    pub fn sync(&mut self) {
        for change in self.pending.drain(..) {
            change.apply(&mut self.durable);
        }
    }

    /// A new file written, synced and renamed over this one, its directory
    /// synced: durable at once, whole.
    pub fn replace(&mut self, bytes: Vec<u8>) {
        self.durable.clone_from(&bytes);
        self.visible = bytes;
        self.pending.clear();
    }

    /// Damage on the disk itself (a flipped bit, lost sectors): `at` is
    /// where, `cut` whether the file ends there instead.
    pub fn damage(&mut self, at: usize, cut: bool) {
        self.sync();
        if at >= self.durable.len() {
            return;
        }
        if cut {
            self.durable.truncate(at);
        } else {
            self.durable[at] ^= 0x10;
        }
        self.visible.clone_from(&self.durable);
    }

    /// The power goes: each change since the last sync is kept or lost
    /// (`keep`), and a kept write may be torn (only a prefix of it
    /// reaches the disk: `tear` gives how many bytes, `None` for all).
    pub fn power_cut(
        &mut self,
        mut keep: impl FnMut(usize) -> bool,
        mut tear: impl FnMut(usize) -> Option<usize>,
    ) -> Cut {
        let mut cut = Cut {
            pending: self.pending.len(),
            ..Cut::default()
        };
        for (i, change) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if !keep(i) {
                continue;
            }
            cut.kept += 1;
            let change = match change {
                Change::Write { offset, bytes } => match tear(bytes.len()) {
                    Some(n) if n < bytes.len() => {
                        cut.torn = true;
                        Change::Write {
                            offset,
                            bytes: bytes[..n].to_vec(),
                        }
                    }
                    _ => Change::Write { offset, bytes },
                },
                other => other,
            };
            change.apply(&mut self.durable);
        }
        self.visible.clone_from(&self.durable);
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_was_synced_is_sure_to_survive() {
        let mut f = File::default();
        f.write(0, b"kept");
        f.sync();
        f.write(4, b" lost");
        assert_eq!(f.bytes(), b"kept lost");
        f.power_cut(|_| false, |_| None);
        assert_eq!(f.bytes(), b"kept");
        f.write(4, b"ab");
        f.write(6, b"cd");
        let cut = f.power_cut(|i| i == 1, |_| None);
        assert_eq!(cut.kept, 1);
        assert_eq!(f.bytes(), b"kept\0\0cd");
        f.write(8, b"xyz");
        let cut = f.power_cut(|_| true, |_| Some(1));
        assert!(cut.torn);
        assert_eq!(f.bytes(), b"kept\0\0cdx");
    }
}
