//! A file system that loses what was not synced, for power-cut tests of the
//! real binary: the idea of LazyFS (the FUSE file system Jepsen used against
//! etcd and others), served by this test process with the `fuser` crate.
//!
//! Every file lives in memory twice: as programs see it, and as the disk
//! would hold it after a power cut (what the last `fsync`/`fdatasync` of the
//! file made durable). Writes since then are kept in order, so a power cut
//! can drop all of them, or keep any subset (the disk may write the pages
//! of one sync in any order, and a cut may land between them). A
//! directory's entries are durable only once the directory itself was
//! synced (`fsync` of the directory): a file created, renamed or removed
//! since is back as it was. Files are opened with `FOPEN_DIRECT_IO` and
//! attributes are never cached, so the kernel holds nothing of its own.
//!
//! Syncs can be made to fail (`EIO`, without making anything durable) or
//! to block until the power cut (the process dies in the middle of a sync).
//! Mounting needs root, as the tmpfs test does.

#![allow(dead_code)] // each test binary uses part of it

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
};

// One change to a file since its last sync, as the simulator's disk keeps it.
use fencegate_sim::disk::Change;

use super::proc::TempDir;

#[derive(Clone, Debug)]
enum Kind {
    File {
        /// What programs read.
        data: Vec<u8>,
        /// What the disk holds: the content at the last sync.
        synced: Vec<u8>,
        /// Changes since the last sync, in order.
        pending: Vec<Change>,
    },
    Dir {
        entries: BTreeMap<OsString, u64>,
        /// The entries at the directory's last sync.
        synced: BTreeMap<OsString, u64>,
    },
}

#[derive(Clone, Debug)]
struct Node {
    kind: Kind,
    perm: u16,
}

/// The whole file system's state.
#[derive(Clone, Debug)]
struct State {
    nodes: BTreeMap<u64, Node>,
    next_ino: u64,
    /// Syncs that fail (with `EIO`, making nothing durable) from now on.
    failing_syncs: u32,
    /// Syncs block until the power cut.
    frozen: bool,
    /// Syncs answered so far (files and directories).
    syncs: u64,
    /// Syncs waiting for the power cut.
    blocked: u32,
}

const ROOT: u64 = 1;

impl State {
    fn new() -> Self {
        let root = Node {
            kind: Kind::Dir {
                entries: BTreeMap::new(),
                synced: BTreeMap::new(),
            },
            perm: 0o755,
        };
        Self {
            nodes: BTreeMap::from([(ROOT, root)]),
            next_ino: 2,
            failing_syncs: 0,
            frozen: false,
            syncs: 0,
            blocked: 0,
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.nodes.get(&ino)?;
        let (kind, size, nlink) = match &node.kind {
            Kind::File { data, .. } => (FileType::RegularFile, data.len() as u64, 1),
            Kind::Dir { .. } => (FileType::Directory, 0, 2),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm: node.perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn entries(&mut self, dir: u64) -> Option<&mut BTreeMap<OsString, u64>> {
        match &mut self.nodes.get_mut(&dir)?.kind {
            Kind::Dir { entries, .. } => Some(entries),
            Kind::File { .. } => None,
        }
    }

    fn child(&self, dir: u64, name: &OsStr) -> Option<u64> {
        match &self.nodes.get(&dir)?.kind {
            Kind::Dir { entries, .. } => entries.get(name).copied(),
            Kind::File { .. } => None,
        }
    }

    fn add(&mut self, parent: u64, name: &OsStr, kind: Kind, perm: u16) -> Result<u64, Errno> {
        if self.child(parent, name).is_some() {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, Node { kind, perm });
        self.entries(parent)
            .ok_or(Errno::ENOTDIR)?
            .insert(name.to_owned(), ino);
        Ok(ino)
    }

    fn change(&mut self, ino: u64, change: Change) -> Result<(), Errno> {
        match &mut self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?.kind {
            Kind::File { data, pending, .. } => {
                change.apply(data);
                pending.push(change);
                Ok(())
            }
            Kind::Dir { .. } => Err(Errno::EISDIR),
        }
    }

    fn sync(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            match &mut node.kind {
                Kind::File {
                    data,
                    synced,
                    pending,
                } => {
                    synced.clone_from(data);
                    pending.clear();
                }
                Kind::Dir { entries, synced } => synced.clone_from(entries),
            }
        }
        self.syncs += 1;
    }

    /// The writes not yet durable, over all files (in inode order, each
    /// file's in the order they were made).
    fn pending_writes(&self) -> usize {
        self.nodes
            .values()
            .map(|n| match &n.kind {
                Kind::File { pending, .. } => pending.len(),
                Kind::Dir { .. } => 0,
            })
            .sum()
    }

    /// What a power cut leaves: each file as synced, plus those of its
    /// changes since that `keep` keeps (numbered as in `pending_writes`);
    /// each directory as synced; whatever no directory names any more is
    /// gone.
    fn cut(&mut self, keep: &dyn Fn(usize) -> bool) {
        let mut n = 0;
        for node in self.nodes.values_mut() {
            match &mut node.kind {
                Kind::File {
                    data,
                    synced,
                    pending,
                } => {
                    let mut disk = synced.clone();
                    for change in pending.drain(..) {
                        if keep(n) {
                            change.apply(&mut disk);
                        }
                        n += 1;
                    }
                    synced.clone_from(&disk);
                    *data = disk;
                }
                Kind::Dir { entries, synced } => entries.clone_from(synced),
            }
        }
        let mut reachable = std::collections::BTreeSet::from([ROOT]);
        let mut todo = vec![ROOT];
        while let Some(dir) = todo.pop() {
            if let Some(Node {
                kind: Kind::Dir { entries, .. },
                ..
            }) = self.nodes.get(&dir)
            {
                for &ino in entries.values() {
                    if reachable.insert(ino) {
                        todo.push(ino);
                    }
                }
            }
        }
        self.nodes.retain(|ino, _| reachable.contains(ino));
        self.failing_syncs = 0;
        self.frozen = false;
    }
}

/// The FUSE side: requests, served one at a time.
struct Served {
    state: Arc<(Mutex<State>, Condvar)>,
}

const TTL: Duration = Duration::ZERO;

impl Served {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sync of `ino`: made durable, failed, or blocked until the cut.
    fn sync(&self, ino: u64, reply: ReplyEmpty) {
        let (lock, cut) = &*self.state;
        let mut state = lock.lock().unwrap_or_else(|p| p.into_inner());
        if state.frozen {
            // The process dies waiting; the cut ends the wait, and nothing
            // was made durable.
            state.blocked += 1;
            while state.frozen {
                state = cut.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            state.blocked -= 1;
            return reply.error(Errno::EIO);
        }
        if state.failing_syncs > 0 {
            state.failing_syncs -= 1;
            // Like Linux after a failed writeback: the data stays in memory,
            // marked clean, and never reaches the disk.
            if let Some(Node {
                kind: Kind::File { pending, .. },
                ..
            }) = state.nodes.get_mut(&ino)
            {
                pending.clear();
            }
            return reply.error(Errno::EIO);
        }
        state.sync(ino);
        reply.ok();
    }
}

impl Filesystem for Served {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let state = self.lock();
        match state.child(parent.0, name).and_then(|ino| state.attr(ino)) {
            Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.lock().attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut state = self.lock();
        if let Some(size) = size {
            if let Err(e) = state.change(ino.0, Change::Truncate(size)) {
                return reply.error(e);
            }
        }
        if let Some(mode) = mode {
            if let Some(node) = state.nodes.get_mut(&ino.0) {
                node.perm = (mode & 0o7777) as u16;
            }
        }
        match state.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let mut state = self.lock();
        let dir = Kind::Dir {
            entries: BTreeMap::new(),
            synced: BTreeMap::new(),
        };
        match state.add(parent.0, name, dir, (mode & 0o7777) as u16) {
            Ok(ino) => reply.entry(&TTL, &state.attr(ino).expect("just made"), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mut state = self.lock();
        let file = Kind::File {
            data: Vec::new(),
            synced: Vec::new(),
            pending: Vec::new(),
        };
        match state.add(parent.0, name, file, (mode & 0o7777) as u16) {
            Ok(ino) => reply.created(
                &TTL,
                &state.attr(ino).expect("just made"),
                Generation(0),
                FileHandle(0),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut state = self.lock();
        match state.entries(parent.0).and_then(|e| e.remove(name)) {
            Some(_) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut state = self.lock();
        let Some(ino) = state.child(parent.0, name) else {
            return reply.error(Errno::ENOENT);
        };
        if matches!(&state.nodes[&ino].kind, Kind::Dir { entries, .. } if !entries.is_empty()) {
            return reply.error(Errno::ENOTEMPTY);
        }
        state.entries(parent.0).expect("a directory").remove(name);
        reply.ok();
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut state = self.lock();
        let Some(ino) = state.entries(parent.0).and_then(|e| e.remove(name)) else {
            return reply.error(Errno::ENOENT);
        };
        match state.entries(newparent.0) {
            Some(entries) => {
                entries.insert(newname.to_owned(), ino);
                reply.ok();
            }
            None => reply.error(Errno::ENOTDIR),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.lock().nodes.contains_key(&ino.0) {
            reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let state = self.lock();
        match state.nodes.get(&ino.0).map(|n| &n.kind) {
            Some(Kind::File { data, .. }) => {
                let from = (offset as usize).min(data.len());
                let to = (from + size as usize).min(data.len());
                reply.data(&data[from..to]);
            }
            Some(Kind::Dir { .. }) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let change = Change::Write {
            offset,
            bytes: data.to_vec(),
        };
        match self.lock().change(ino.0, change) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.sync(ino.0, reply);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let state = self.lock();
        let Some(Node {
            kind: Kind::Dir { entries, .. },
            ..
        }) = state.nodes.get(&ino.0)
        else {
            return reply.error(Errno::ENOTDIR);
        };
        let listed = [
            (ino.0, FileType::Directory, OsString::from(".")),
            (ROOT, FileType::Directory, OsString::from("..")),
        ]
        .into_iter()
        .chain(entries.iter().map(|(name, &child)| {
            let kind = match state.nodes.get(&child).map(|n| &n.kind) {
                Some(Kind::Dir { .. }) => FileType::Directory,
                _ => FileType::RegularFile,
            };
            (child, kind, name.clone())
        }));
        for (i, (child, kind, name)) in listed.enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.sync(ino.0, reply);
    }
}

/// The file system, mounted on a directory of its own.
pub struct LazyFs {
    state: Arc<(Mutex<State>, Condvar)>,
    session: Option<BackgroundSession>,
    mount: PathBuf,
    _dir: TempDir,
}

impl LazyFs {
    /// An empty file system, mounted (needs root).
    pub fn mount(tag: &str) -> Self {
        assert!(
            super::tools::is_root(),
            "the power-cut tests mount a FUSE file system, which needs root (as CI has)"
        );
        let dir = TempDir::new(tag);
        let mount = dir.path().join("mnt");
        std::fs::create_dir_all(&mount).unwrap();
        let mut fs = Self {
            state: Arc::new((Mutex::new(State::new()), Condvar::new())),
            session: None,
            mount,
            _dir: dir,
        };
        fs.mount_again();
        fs
    }

    fn mount_again(&mut self) {
        let mut config = Config::default();
        config.mount_options = vec![MountOption::FSName("fencegate-lazyfs".into())];
        // More than one: a sync blocked until the power cut must not keep
        // the dying process's last flushes and closes from being answered.
        config.n_threads = Some(4);
        let served = Served {
            state: self.state.clone(),
        };
        self.session = Some(
            fuser::spawn_mount(served, &self.mount, &config)
                .unwrap_or_else(|e| panic!("cannot mount the FUSE file system: {e}")),
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// The next `n` syncs fail with `EIO` and make nothing durable (their
    /// writes stay readable until the power cut, as Linux's page cache
    /// keeps pages whose writeback failed, marked clean).
    pub fn fail_syncs(&self, n: u32) {
        self.lock().failing_syncs = n;
    }

    /// From now on a sync waits until [`LazyFs::thaw_syncs`] or the power
    /// cut, and fails then.
    pub fn freeze_syncs(&self) {
        self.lock().frozen = true;
    }

    /// Ends the syncs that wait (failing them, making nothing durable):
    /// call it once their process was sent SIGKILL, which does not end a
    /// process inside a FUSE request until the request is answered.
    pub fn thaw_syncs(&self) {
        self.lock().frozen = false;
        self.state.1.notify_all();
    }

    /// Syncs answered so far.
    pub fn syncs(&self) -> u64 {
        self.lock().syncs
    }

    /// Syncs waiting for the power cut (see [`LazyFs::freeze_syncs`]).
    pub fn blocked_syncs(&self) -> u32 {
        self.lock().blocked
    }

    /// Writes made since each file's last sync, over all files.
    pub fn pending_writes(&self) -> usize {
        self.lock().pending_writes()
    }

    /// A power cut. Every process using the file system must be dead
    /// (killed) first. The disk keeps what was synced, and of the writes
    /// since those `keep` keeps (numbered as in `pending_writes`); then the
    /// file system is mounted again.
    pub fn power_cut(&mut self, keep: impl Fn(usize) -> bool) {
        {
            let (lock, cut) = &*self.state;
            let mut state = lock.lock().unwrap_or_else(|p| p.into_inner());
            state.frozen = false;
            cut.notify_all();
        }
        if let Some(session) = self.session.take() {
            // Unmount, then wait for the serving thread to stop.
            let _ = session.umount_and_join();
        }
        self.lock().cut(&keep);
        self.mount_again();
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        self.lock().frozen = false;
        self.state.1.notify_all();
        if let Some(session) = self.session.take() {
            let _ = session.umount_and_join();
        }
    }
}
