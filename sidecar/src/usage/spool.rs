//! The usage spool: a durable, append-only journal of usage events on local disk, between the
//! filter and Kafka.
//!
//! Why: a usage event is acknowledged to the filter (which then forgets it) only once it is on
//! disk, so neither a Kafka outage nor a sidecar crash loses what was acknowledged. Kafka gets
//! the events from here, in order, and a segment is deleted only when every event in it was
//! acknowledged by the broker (`acks=all`).
//!
//! Layout: `<dir>/<seq:020>.open` is the segment being written (at most one), `<dir>/<seq>.seg`
//! are sealed segments waiting to be shipped, oldest first. Each line is one event's JSON (ending
//! `,"aggregate":true}` when intake marked it for per-second aggregation: tollgate_shared::aggregate).
//!
//! Invariants:
//! - `append` returns only after the bytes are `fdatasync`ed (group commit: one sync for every
//!   append waiting at that moment), and a new segment's directory entry is synced too.
//! - A crash leaves at most one `.open` segment; opening the spool seals it. A torn last line
//!   (written, never acknowledged) does not parse and is skipped by readers and counted; the
//!   filter still holds that batch and sends it again.
//! - Events may be shipped more than once (a crash between Kafka's ack and the delete); the
//!   billing consumer counts each event id once.
//! - A failed write (a full disk) cuts the segment back to its last whole line and the batch is
//!   refused (503: the filter keeps it and retries); a failed sync cuts back to the last durable
//!   length; a failed seal leaves the segment open and is retried at the next tick.
//! - The spool is bounded (`max_bytes`): past it `append` fails with [`SpoolError::Full`] and the
//!   sidecar answers 503, so the filter keeps the events (back-pressure instead of loss).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A segment is sealed once it is this big, whatever its age.
pub const MAX_SEGMENT_BYTES: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("the usage spool is full ({0} bytes)")]
    Full(u64),
    #[error("usage spool i/o: {0}")]
    Io(#[from] io::Error),
    #[error("the usage spool is stopped")]
    Stopped,
    #[error("an earlier copy of this batch is still being written; send it again shortly")]
    InFlight,
}

struct OpenSegment {
    file: File,
    path: PathBuf,
    bytes: u64,
    opened: Instant,
}

/// The writing side (one per spool directory; used from one thread).
pub struct SpoolWriter {
    dir: PathBuf,
    current: Option<OpenSegment>,
    next_seq: u64,
    /// Bytes in the directory (open + sealed segments), shared with the shipper.
    total: Arc<AtomicU64>,
    max_bytes: u64,
    /// `<dir>/.lock`, locked for the writer's life: one sidecar per spool (decision 190).
    _lock: File,
}

fn seq_of(path: &Path) -> Option<u64> {
    path.file_stem()?.to_str()?.parse().ok()
}

fn with_ext(path: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(path)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == ext) && seq_of(p).is_some())
                .collect()
        })
        .unwrap_or_default();
    out.sort_by_key(|p| seq_of(p));
    out
}

/// Sealed segments, oldest first.
pub fn sealed_segments(dir: &Path) -> Vec<PathBuf> {
    with_ext(dir, "seg")
}

/// The lines of a segment, skipping (and counting) those that are not complete JSON objects.
pub fn read_segment(path: &Path) -> io::Result<(Vec<Vec<u8>>, usize)> {
    Ok(decode_segment(&fs::read(path)?))
}

/// The spool line decoder: the complete JSON lines of a segment's bytes, and how many lines were
/// not JSON (a torn last line after a crash, a corrupted disk). Fuzzed (`fuzz/`, `spool_lines`).
pub fn decode_segment(bytes: &[u8]) -> (Vec<Vec<u8>>, usize) {
    let (mut lines, mut bad) = (Vec::new(), 0);
    for line in bytes.split(|b| *b == b'\n') {
        if line.is_empty() {
            continue;
        }
        if serde_json::from_slice::<serde::de::IgnoredAny>(line).is_ok() {
            lines.push(line.to_vec());
        } else {
            bad += 1;
        }
    }
    (lines, bad)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl SpoolWriter {
    /// Opens (creating) the spool directory and seals a segment a crash left open.
    /// The directory is this writer's alone: a second writer on it (another sidecar given the
    /// same `spool_dir`, an old pod still running beside its replacement on a shared volume) is
    /// refused, for its start would seal the first's open segment under it (the first kept
    /// appending to a file the shipper then deleted: acknowledged events lost; decision 190).
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<SpoolWriter> {
        fs::create_dir_all(dir)?;
        let lock = File::options().create(true).truncate(false).write(true).open(dir.join(".lock"))?;
        if let Err(e) = lock.try_lock() {
            let why = match e {
                fs::TryLockError::WouldBlock => "another process holds it (each sidecar needs its own spool_dir)".to_string(),
                fs::TryLockError::Error(e) => e.to_string(),
            };
            return Err(io::Error::new(io::ErrorKind::ResourceBusy, format!("the usage spool {} is in use: {why}", dir.display())));
        }
        for open in with_ext(dir, "open") {
            fs::rename(&open, open.with_extension("seg"))?;
        }
        let sealed = sealed_segments(dir);
        let next_seq = sealed.last().and_then(|p| seq_of(p)).map_or(1, |s| s + 1);
        let total: u64 = sealed.iter().filter_map(|p| fs::metadata(p).ok()).map(|m| m.len()).sum();
        sync_dir(dir)?;
        Ok(SpoolWriter {
            dir: dir.to_path_buf(),
            current: None,
            next_seq,
            total: Arc::new(AtomicU64::new(total)),
            max_bytes,
            _lock: lock,
        })
    }

    /// Bytes held in the spool (shared: the shipper subtracts what it deletes).
    pub fn total(&self) -> Arc<AtomicU64> {
        self.total.clone()
    }

    /// Appends `data` (whole lines) to the open segment; durable only after [`SpoolWriter::sync`].
    pub fn append(&mut self, data: &[u8]) -> Result<(), SpoolError> {
        let held = self.total.load(Ordering::Relaxed);
        if held + data.len() as u64 > self.max_bytes {
            return Err(SpoolError::Full(held));
        }
        if self.current.is_none() {
            let path = self.dir.join(format!("{:020}.open", self.next_seq));
            self.next_seq += 1;
            let file = OpenOptions::new().create_new(true).append(true).open(&path)?;
            // the new file's directory entry must survive a power loss too
            sync_dir(&self.dir)?;
            self.current = Some(OpenSegment { file, path, bytes: 0, opened: Instant::now() });
        }
        let Some(seg) = self.current.as_mut() else { return Err(SpoolError::Stopped) };
        if let Err(e) = seg.file.write_all(data) {
            // A full disk (or any write error) may have left part of `data`: cut the segment
            // back to its last whole line, or the next batch's first line would glue onto the
            // partial one and be skipped as torn. If even that fails, seal the segment here (its
            // torn tail is then its last line) and start a fresh one for the next batch.
            if let Err(cut) = seg.file.set_len(seg.bytes) {
                tracing::error!(error = %cut, "usage spool: cannot truncate a failed write; sealing the segment");
                if let Err(seal) = self.seal() {
                    tracing::error!(error = %seal, "usage spool: cannot seal it either; it is sealed at the next start");
                    self.current = None;
                }
            }
            return Err(SpoolError::Io(e));
        }
        seg.bytes += data.len() as u64;
        self.total.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Cuts the open segment back to `len` bytes (the bytes after it were refused): after a
    /// failed sync, to what the last good sync made durable.
    pub fn truncate_to(&mut self, len: u64) -> io::Result<()> {
        let Some(seg) = self.current.as_mut() else { return Ok(()) };
        if len >= seg.bytes {
            return Ok(());
        }
        seg.file.set_len(len)?;
        let cut = seg.bytes - len;
        seg.bytes = len;
        let _ = self.total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t.saturating_sub(cut)));
        Ok(())
    }

    /// Bytes in the open segment (0 when none).
    pub fn open_bytes(&self) -> u64 {
        self.current.as_ref().map_or(0, |s| s.bytes)
    }

    /// Makes every appended byte durable.
    pub fn sync(&mut self) -> io::Result<()> {
        match &self.current {
            Some(seg) => seg.file.sync_data(),
            None => Ok(()),
        }
    }

    /// Seals the open segment when it is non-empty and at least `max_age` old (or big): it
    /// becomes shippable. Returns whether a segment was sealed.
    pub fn seal_if_due(&mut self, max_age: Duration) -> io::Result<bool> {
        let due = self
            .current
            .as_ref()
            .is_some_and(|s| s.bytes > 0 && (s.opened.elapsed() >= max_age || s.bytes >= MAX_SEGMENT_BYTES));
        if due {
            self.seal()?;
        }
        Ok(due)
    }

    /// Seals the open segment now, if any. On failure the segment stays open (and is appended
    /// to) and sealing is tried again at the next tick.
    pub fn seal(&mut self) -> io::Result<()> {
        if let Some(seg) = &self.current {
            seg.file.sync_data()?;
            if seg.bytes == 0 {
                fs::remove_file(&seg.path)?;
            } else {
                fs::rename(&seg.path, seg.path.with_extension("seg"))?;
            }
            self.current = None;
        }
        Ok(())
    }
}

/// Deletes a shipped segment and gives its bytes back.
pub fn remove_segment(path: &Path, total: &AtomicU64) -> io::Result<()> {
    let len = fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    fs::remove_file(path)?;
    let _ = total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t.saturating_sub(len)));
    Ok(())
}

// ---- the writer thread and its async handle -------------------------------------------------

enum Cmd {
    Append(Vec<u8>, tokio::sync::oneshot::Sender<Result<(), SpoolError>>),
    Stop(tokio::sync::oneshot::Sender<()>),
}

/// A handle on the spool's writer thread. Cheap to clone.
#[derive(Clone)]
pub struct Spool {
    tx: std::sync::mpsc::Sender<Cmd>,
    total: Arc<AtomicU64>,
    dir: PathBuf,
}

impl Spool {
    /// Opens the spool and starts its writer thread. `sealed` is notified whenever a segment
    /// becomes shippable; an open segment is sealed once it is `segment_age` old.
    pub fn start(dir: &Path, max_bytes: u64, segment_age: Duration, sealed: Arc<tokio::sync::Notify>) -> io::Result<Spool> {
        let mut writer = SpoolWriter::open(dir, max_bytes)?;
        let total = writer.total();
        let (tx, rx) = std::sync::mpsc::channel::<Cmd>();
        std::thread::Builder::new().name("usage-spool".into()).spawn(move || {
            let tick = (segment_age / 2).max(Duration::from_millis(5));
            let mut stopped = None;
            while stopped.is_none() {
                let mut acks = Vec::new();
                // what the last good sync made durable in the open segment
                let durable = writer.open_bytes();
                match rx.recv_timeout(tick) {
                    Ok(cmd) => {
                        let mut next = Some(cmd);
                        // group commit: take every append already waiting, then sync once
                        while let Some(cmd) = next.take() {
                            match cmd {
                                Cmd::Append(data, ack) => {
                                    let r = writer.append(&data);
                                    acks.push((ack, r));
                                }
                                Cmd::Stop(done) => stopped = Some(done),
                            }
                            if stopped.is_none() {
                                next = rx.try_recv().ok();
                            }
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                }
                let synced = if acks.iter().any(|(_, r)| r.is_ok()) { writer.sync() } else { Ok(()) };
                for (ack, r) in acks {
                    let r = match (&synced, r) {
                        (Err(e), Ok(())) => Err(SpoolError::Io(io::Error::new(e.kind(), e.to_string()))),
                        (_, r) => r,
                    };
                    let _ = ack.send(r);
                }
                if let Err(e) = synced {
                    tracing::error!(error = %e, "usage spool: sync failed; the batch is refused (the filter retries)");
                    // the refused bytes go (a retried batch must not be in the spool twice), and a
                    // failed fsync may have lost bytes: start a fresh segment
                    if let Err(e) = writer.truncate_to(durable) {
                        tracing::error!(error = %e, "usage spool: cannot cut back after a failed sync");
                    }
                    let _ = writer.seal();
                }
                match writer.seal_if_due(segment_age) {
                    Ok(true) => sealed.notify_one(),
                    Ok(false) => {}
                    Err(e) => tracing::error!(error = %e, "usage spool: cannot seal a segment; retrying at the next tick"),
                }
            }
            if let Err(e) = writer.seal() {
                tracing::error!(error = %e, "usage spool: cannot seal the last segment");
            }
            sealed.notify_one();
            if let Some(done) = stopped {
                let _ = done.send(());
            }
        })?;
        Ok(Spool { tx, total, dir: dir.to_path_buf() })
    }

    /// Appends whole lines; resolves once they are durable.
    pub async fn append(&self, data: Vec<u8>) -> Result<(), SpoolError> {
        let (ack, done) = tokio::sync::oneshot::channel();
        self.tx.send(Cmd::Append(data, ack)).map_err(|_| SpoolError::Stopped)?;
        done.await.map_err(|_| SpoolError::Stopped)?
    }

    /// Seals the open segment and stops the writer thread.
    pub async fn stop(&self) {
        let (done, wait) = tokio::sync::oneshot::channel();
        if self.tx.send(Cmd::Stop(done)).is_ok() {
            let _ = wait.await;
        }
    }

    pub fn total(&self) -> Arc<AtomicU64> {
        self.total.clone()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(n: std::ops::Range<u32>) -> Vec<u8> {
        n.map(|i| format!("{{\"id\":\"{i}\"}}\n")).collect::<String>().into_bytes()
    }

    #[test]
    fn appends_seal_into_ordered_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SpoolWriter::open(dir.path(), 1 << 20).unwrap();
        w.append(&lines(0..2)).unwrap();
        w.sync().unwrap();
        assert!(sealed_segments(dir.path()).is_empty(), "an open segment is not shippable");
        assert!(!w.seal_if_due(Duration::from_secs(60)).unwrap());
        assert!(w.seal_if_due(Duration::ZERO).unwrap());
        w.append(&lines(2..3)).unwrap();
        w.seal().unwrap();
        let segs = sealed_segments(dir.path());
        assert_eq!(segs.len(), 2);
        assert_eq!(read_segment(&segs[0]).unwrap().0.len(), 2);
        assert_eq!(read_segment(&segs[1]).unwrap().0, vec![b"{\"id\":\"2\"}".to_vec()]);
        assert_eq!(w.total().load(Ordering::Relaxed), lines(0..3).len() as u64);
        remove_segment(&segs[0], &w.total()).unwrap();
        assert_eq!(w.total().load(Ordering::Relaxed), lines(2..3).len() as u64);
    }

    /// Decision 190: a second writer on a spool in use is refused (it would seal the first's open
    /// segment under it); once the first is gone, the directory opens again.
    #[test]
    fn a_spool_in_use_is_refused_to_a_second_writer() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = SpoolWriter::open(dir.path(), 1 << 20).unwrap();
        first.append(&lines(0..2)).unwrap();
        first.sync().unwrap();
        let Err(e) = SpoolWriter::open(dir.path(), 1 << 20) else { panic!("a second writer opened a spool in use") };
        assert!(e.to_string().contains("in use"), "{e}");
        assert_eq!(with_ext(dir.path(), "open").len(), 1, "the first's open segment left as it was");
        drop(first);
        let again = SpoolWriter::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(sealed_segments(dir.path()).len(), 1, "a crash's open segment is sealed by the next writer");
        drop(again);
    }

    #[test]
    fn a_crash_leaves_an_open_segment_that_the_next_open_seals_and_a_torn_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SpoolWriter::open(dir.path(), 1 << 20).unwrap();
        w.append(&lines(0..3)).unwrap();
        w.append(b"{\"id\":\"torn").unwrap(); // the crash hit mid-write
        w.sync().unwrap();
        drop(w); // no seal: a crash
        let w = SpoolWriter::open(dir.path(), 1 << 20).unwrap();
        let segs = sealed_segments(dir.path());
        assert_eq!(segs.len(), 1);
        let (good, bad) = read_segment(&segs[0]).unwrap();
        assert_eq!((good.len(), bad), (3, 1));
        assert!(w.total().load(Ordering::Relaxed) > 0);
        // numbering continues after what is there
        let mut w = w;
        w.append(&lines(9..10)).unwrap();
        w.seal().unwrap();
        let segs = sealed_segments(dir.path());
        assert_eq!(segs.len(), 2);
        assert!(seq_of(&segs[1]) > seq_of(&segs[0]));
    }

    #[test]
    fn the_spool_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SpoolWriter::open(dir.path(), 30).unwrap();
        w.append(&lines(0..2)).unwrap(); // 22 bytes
        assert!(matches!(w.append(&lines(2..3)), Err(SpoolError::Full(22))));
    }

    /// A real full disk: a tmpfs this test mounts (the machine must allow it: root).
    struct SmallDisk(tempfile::TempDir);
    impl SmallDisk {
        fn mount(size: &str) -> SmallDisk {
            let dir = tempfile::tempdir().unwrap();
            let out = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir.path()).output().unwrap();
            assert!(out.status.success(), "mounting a tmpfs (the full-disk test needs root): {}", String::from_utf8_lossy(&out.stderr));
            SmallDisk(dir)
        }
    }
    impl Drop for SmallDisk {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0.path()).status();
        }
    }

    #[test]
    fn a_full_disk_refuses_the_batch_cuts_back_and_loses_no_acknowledged_line() {
        let disk = SmallDisk::mount("64k");
        let dir = disk.0.path().join("spool");
        let mut w = SpoolWriter::open(&dir, 1 << 30).unwrap();
        // lines of 1000 bytes until the disk is full
        let line = |i: u32| format!("{{\"id\":\"{i:06}\",\"pad\":\"{}\"}}\n", "x".repeat(975)).into_bytes();
        let mut acked = Vec::new();
        let mut refused = None;
        for i in 0..200 {
            let batch: Vec<u8> = [line(2 * i), line(2 * i + 1)].concat();
            match w.append(&batch) {
                Ok(()) => {
                    w.sync().unwrap();
                    acked.extend([2 * i, 2 * i + 1]);
                }
                Err(SpoolError::Io(e)) => {
                    assert_eq!(e.raw_os_error(), Some(28), "ENOSPC: {e}");
                    refused = Some(i);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        let refused = refused.expect("the disk filled up");
        assert!(!acked.is_empty());
        // the segment holds whole lines only, and the spool's count matches the file
        let open = with_ext(&dir, "open");
        assert_eq!(fs::metadata(&open[0]).unwrap().len(), w.total().load(Ordering::Relaxed));
        assert_eq!(fs::metadata(&open[0]).unwrap().len() % 1000, 0, "a partial line was left");
        // space comes back (the shipper deleted a segment, an operator cleaned up): the refused
        // batch, sent again, lands whole. On a fresh tmpfs: the space of files deleted from a
        // full one was once seen still taken a moment later (ENOSPC on the resend, one run in
        // many), which is the kernel's accounting, not the spool's.
        drop(w);
        drop(disk);
        let disk = SmallDisk::mount("64k");
        let dir = disk.0.path().join("spool");
        let mut w = SpoolWriter::open(&dir, 1 << 30).unwrap();
        let batch: Vec<u8> = [line(2 * refused), line(2 * refused + 1)].concat();
        w.append(&batch).unwrap();
        w.seal().unwrap();
        let (good, bad) = read_segment(&sealed_segments(&dir)[0]).unwrap();
        assert_eq!((good.len(), bad), (2, 0));
    }

    #[test]
    fn after_a_refused_write_the_next_batch_is_not_glued_to_a_partial_line() {
        let disk = SmallDisk::mount("48k");
        let dir = disk.0.path().join("spool");
        let mut w = SpoolWriter::open(&dir, 1 << 30).unwrap();
        let big = |i: u32, pad: usize| format!("{{\"id\":\"{i}\",\"pad\":\"{}\"}}\n", "y".repeat(pad)).into_bytes();
        let mut acked = 0;
        let mut i = 0;
        // fill with big lines until one fails (partly written), then small lines fit again
        loop {
            i += 1;
            match w.append(&big(i, 3000)) {
                Ok(()) => acked += 1,
                Err(_) => break,
            }
            assert!(i < 100, "the disk never filled");
        }
        let mut small_acked = 0;
        for j in 0..50 {
            if w.append(&big(1000 + j, 10)).is_ok() {
                small_acked += 1;
            }
        }
        w.sync().unwrap_or_default();
        w.seal().unwrap_or_default();
        drop(w);
        let w = SpoolWriter::open(&dir, 1 << 30).unwrap();
        let (good, bad) = read_segment(&sealed_segments(&dir)[0]).unwrap();
        assert_eq!(bad, 0, "a torn line: a partial write was left in the segment");
        assert_eq!(good.len(), acked + small_acked, "every acknowledged line is there");
        drop(w);
    }

    #[tokio::test]
    async fn the_writer_thread_acknowledges_after_sync_and_seals_by_age() {
        let dir = tempfile::tempdir().unwrap();
        let sealed = Arc::new(tokio::sync::Notify::new());
        let spool = Spool::start(dir.path(), 1 << 20, Duration::from_millis(20), sealed.clone()).unwrap();
        let appends: Vec<_> = (0..10).map(|i| spool.append(lines(i..i + 1))).collect();
        for r in futures_join(appends).await {
            r.unwrap();
        }
        // sealed by age, without a stop
        tokio::time::timeout(Duration::from_secs(10), sealed.notified()).await.unwrap();
        assert!(!sealed_segments(dir.path()).is_empty());
        spool.stop().await;
        let n: usize = sealed_segments(dir.path()).iter().map(|s| read_segment(s).unwrap().0.len()).sum();
        assert_eq!(n, 10);
        assert!(matches!(spool.append(lines(0..1)).await, Err(SpoolError::Stopped)));
    }

    async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
        let mut out = Vec::new();
        for f in fs {
            out.push(f.await);
        }
        out
    }
}
