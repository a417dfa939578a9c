//! The on-disk record format of a trajectory log, appending with an fsync policy, and the scan
//! on open that detects a torn tail (cut) or corruption inside the file (refused, never misread).
//!
//! A log is a sequence of frames, each
//!
//! ```text
//! magic "DSTR" (4 bytes) | len: u32 LE | crc32(payload): u32 LE | payload: `len` bytes of JSON
//! ```
//!
//! The payload is one [`TrajectoryRecord`]. Frames are written with one `write(2)` each under
//! the log's lock, so after a crash only the last frame can be incomplete. On open the frames
//! are checked in order; the first bad one (short, wrong magic, absurd length, CRC mismatch,
//! undecodable JSON, out-of-order `seq`) ends the valid prefix. If no valid frame follows it,
//! it is a torn tail and the file is truncated to the valid prefix; if a valid frame does follow,
//! the damage is inside the file and opening fails with [`OpenLogError::Corrupt`].

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use dsec_wire::api::TrajectoryRecord;
use serde::{Deserialize, Serialize};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"DSTR";
/// Header bytes before the payload.
pub const HEADER: usize = 12;
/// Largest payload accepted when reading (records keep large outputs out of line).
pub const MAX_PAYLOAD: u32 = 16 * 1024 * 1024;

/// When appended records reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// `fdatasync` after every record, before the call is answered.
    Always,
    /// `fdatasync` by a background task every `fsync_interval_ms` (group commit; the default); a
    /// machine crash may lose that window, a process crash loses nothing (records are `write`n
    /// before the call is answered).
    #[default]
    Batch,
    /// Never `fdatasync`; the kernel writes back when it likes.
    Never,
}

/// Why a log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenLogError {
    #[error("open trajectory log {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trajectory log {path} is corrupt at byte {offset} ({why}) with valid records after it; it was left as is")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        why: FrameError,
    },
}

/// Why a record could not be appended.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error("encode trajectory record: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("trajectory record of {0} bytes is above the {MAX_PAYLOAD}-byte limit")]
    TooLarge(usize),
    #[error("write trajectory log {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// CRC-32 (IEEE).
pub fn crc32(data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(data);
    h.finalize()
}

/// One frame's bytes.
pub fn encode_frame(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + payload.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(&crc32(payload).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Where a valid record sits in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub offset: u64,
    pub len: u32,
}

/// Why the bytes at an offset are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("{0} bytes, shorter than a frame header")]
    ShortHeader(usize),
    #[error("bad magic")]
    BadMagic,
    #[error("length {0} above the limit")]
    TooLong(u32),
    #[error("frame of {end} bytes but only {left} left (torn write)")]
    Torn { end: usize, left: usize },
    #[error("CRC mismatch")]
    CrcMismatch,
    #[error("undecodable record: {0}")]
    Undecodable(String),
    #[error("seq {found} where {expected} was expected")]
    OutOfSequence { found: u64, expected: u64 },
}

/// The frame at `off`: `Ok((record, frame_len))` or why it is not a valid frame.
fn decode_at(buf: &[u8], off: usize) -> Result<(TrajectoryRecord, usize), FrameError> {
    let rest = &buf[off..];
    if rest.len() < HEADER {
        return Err(FrameError::ShortHeader(rest.len()));
    }
    if rest[..4] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    let len = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
    let crc = u32::from_le_bytes([rest[8], rest[9], rest[10], rest[11]]);
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLong(len));
    }
    let end = HEADER + len as usize;
    if rest.len() < end {
        return Err(FrameError::Torn {
            end,
            left: rest.len(),
        });
    }
    let payload = &rest[HEADER..end];
    if crc32(payload) != crc {
        return Err(FrameError::CrcMismatch);
    }
    let rec: TrajectoryRecord =
        serde_json::from_slice(payload).map_err(|e| FrameError::Undecodable(e.to_string()))?;
    Ok((rec, end))
}

/// Result of scanning a log's bytes.
#[derive(Debug)]
pub struct Scan {
    pub records: Vec<(TrajectoryRecord, Position)>,
    /// Length of the valid prefix.
    pub valid_len: u64,
    /// The first bad frame: offset and why.
    pub bad: Option<(u64, FrameError)>,
    /// A valid frame exists after the bad one (corruption, not a torn tail).
    pub valid_after_bad: bool,
}

/// Checks every frame of `buf` (pure; see the module docs).
pub fn scan(buf: &[u8]) -> Scan {
    let mut records = Vec::new();
    let mut off = 0usize;
    let mut bad = None;
    while off < buf.len() {
        match decode_at(buf, off) {
            Ok((rec, n)) => {
                let expected = records.len() as u64 + 1;
                if rec.seq != expected {
                    bad = Some((
                        off as u64,
                        FrameError::OutOfSequence {
                            found: rec.seq,
                            expected,
                        },
                    ));
                    break;
                }
                records.push((
                    rec,
                    Position {
                        offset: off as u64,
                        len: n as u32,
                    },
                ));
                off += n;
            }
            Err(why) => {
                bad = Some((off as u64, why));
                break;
            }
        }
    }
    let valid_after_bad = match &bad {
        None => false,
        Some((at, _)) => {
            let start = *at as usize + 1;
            (start..buf.len().saturating_sub(HEADER - 1))
                .any(|i| buf[i..].starts_with(&MAGIC) && decode_at(buf, i).is_ok())
        }
    };
    Scan {
        records,
        valid_len: off as u64,
        bad,
        valid_after_bad,
    }
}

/// What opening found.
#[derive(Debug, Default)]
pub struct Opened {
    pub records: Vec<(TrajectoryRecord, Position)>,
    /// Bytes of torn tail that were cut.
    pub cut_bytes: u64,
}

/// An open, append-only log file.
pub struct LogFile {
    path: PathBuf,
    file: File,
    len: u64,
    next_seq: u64,
    policy: FsyncPolicy,
    dirty: bool,
}

impl LogFile {
    /// Opens (creating) the log at `path`, cutting a torn tail.
    pub fn open(path: &Path, policy: FsyncPolicy) -> Result<(LogFile, Opened), OpenLogError> {
        let io = |source| OpenLogError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io)?;
        let s = scan(&buf);
        let mut cut_bytes = 0;
        if let Some((offset, why)) = s.bad {
            if s.valid_after_bad {
                return Err(OpenLogError::Corrupt {
                    path: path.to_path_buf(),
                    offset,
                    why,
                });
            }
            cut_bytes = buf.len() as u64 - s.valid_len;
            file.set_len(s.valid_len).map_err(io)?;
            file.sync_all().map_err(io)?;
            tracing::warn!(log = %path.display(), offset, cut_bytes, reason = %why, "cut the torn tail of a trajectory log");
        }
        let next_seq = s.records.len() as u64 + 1;
        Ok((
            LogFile {
                path: path.to_path_buf(),
                file,
                len: s.valid_len,
                next_seq,
                policy,
                dirty: false,
            },
            Opened {
                records: s.records,
                cut_bytes,
            },
        ))
    }

    /// Creates the log of a new sandbox: no file is expected, so none is read or scanned (one
    /// `openat(O_CREAT|O_EXCL)` instead of open + read + scan). A file already there (a
    /// re-adopted sandbox's) is opened as [`LogFile::open`] does, torn tail and all.
    pub fn create(path: &Path, policy: FsyncPolicy) -> Result<(LogFile, Opened), OpenLogError> {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => Ok((
                LogFile {
                    path: path.to_path_buf(),
                    file,
                    len: 0,
                    next_seq: 1,
                    policy,
                    dirty: false,
                },
                Opened::default(),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Self::open(path, policy),
            Err(source) => Err(OpenLogError::Io {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `seq` the next record gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Appends `rec` (its `seq` is set here), syncing per the policy.
    pub fn append(&mut self, rec: &mut TrajectoryRecord) -> Result<Position, AppendError> {
        rec.seq = self.next_seq;
        let payload = serde_json::to_vec(rec)?;
        if payload.len() > MAX_PAYLOAD as usize {
            return Err(AppendError::TooLarge(payload.len()));
        }
        let frame = encode_frame(&payload);
        let io = |source| AppendError::Io {
            path: self.path.clone(),
            source,
        };
        // One write at the end: O_APPEND is not used so that a failed partial write can be
        // cut back to `len` and the file never holds half a frame followed by a good one.
        if let Err(e) = self.file.write_all_at(&frame, self.len) {
            let _ = self.file.set_len(self.len);
            return Err(io(e));
        }
        if self.policy == FsyncPolicy::Always {
            self.file.sync_data().map_err(io)?;
        } else {
            self.dirty = true;
        }
        let pos = Position {
            offset: self.len,
            len: frame.len() as u32,
        };
        self.len += frame.len() as u64;
        self.next_seq += 1;
        Ok(pos)
    }

    /// Syncs pending writes (the batch policy's group commit, and on close).
    pub fn sync(&mut self) -> std::io::Result<()> {
        if self.dirty {
            self.file.sync_data()?;
            self.dirty = false;
        }
        Ok(())
    }

    /// Whether records were written since the last sync.
    pub fn has_pending_sync(&self) -> bool {
        self.dirty
    }

    /// For a group commit outside the log's lock: a handle to `fdatasync` when records were
    /// written since the last sync (they are marked synced; a failed sync is logged by the caller).
    pub fn take_pending_sync(&mut self) -> Option<std::io::Result<File>> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        Some(self.file.try_clone())
    }

    /// Reads back the record at `pos`.
    pub fn read_at(&self, pos: Position) -> std::io::Result<TrajectoryRecord> {
        let mut buf = vec![0u8; pos.len as usize];
        self.file.read_exact_at(&mut buf, pos.offset)?;
        decode_at(&buf, 0)
            .map(|(r, _)| r)
            .map_err(|why| std::io::Error::other(format!("record at {}: {why}", pos.offset)))
    }
}

/// Reads every valid record of a log without changing it (a torn tail is ignored).
pub fn read_all(path: &Path) -> std::io::Result<Vec<TrajectoryRecord>> {
    let mut buf = Vec::new();
    File::open(path)?.read_to_end(&mut buf)?;
    Ok(scan(&buf).records.into_iter().map(|(r, _)| r).collect())
}

/// Writes `bytes` to `path` whole (for tests and tools).
pub fn write_raw(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: &str) -> TrajectoryRecord {
        TrajectoryRecord {
            kind: kind.into(),
            ok: true,
            start_ms: 1.0,
            end_ms: 2.0,
            ..Default::default()
        }
    }

    fn write_three(path: &Path) -> Vec<Position> {
        let (mut log, opened) = LogFile::open(path, FsyncPolicy::Always).unwrap();
        assert!(opened.records.is_empty());
        (0..3)
            .map(|i| log.append(&mut rec(&format!("k{i}"))).unwrap())
            .collect()
    }

    #[test]
    fn crc_known_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn roundtrip_and_seq() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.log");
        let pos = write_three(&p);
        let (log, opened) = LogFile::open(&p, FsyncPolicy::Never).unwrap();
        assert_eq!(opened.cut_bytes, 0);
        let seqs: Vec<u64> = opened.records.iter().map(|(r, _)| r.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        assert_eq!(log.next_seq(), 4);
        assert_eq!(log.read_at(pos[1]).unwrap().kind, "k1");
        assert_eq!(opened.records[2].1, pos[2]);
    }

    #[test]
    fn torn_tail_is_cut_at_every_length() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.log");
        let pos = write_three(&p);
        let full = std::fs::read(&p).unwrap();
        let last = pos[2];
        // Every strict prefix of the last frame is a torn tail: cut, never misread.
        for keep in 0..last.len as u64 {
            let cut_at = last.offset + keep;
            write_raw(&p, &full[..cut_at as usize]).unwrap();
            let (mut log, opened) = LogFile::open(&p, FsyncPolicy::Never).unwrap();
            assert_eq!(opened.records.len(), 2, "keep {keep}");
            assert_eq!(opened.cut_bytes, keep);
            assert_eq!(std::fs::metadata(&p).unwrap().len(), last.offset);
            // Appending after the cut continues the sequence.
            log.append(&mut rec("again")).unwrap();
            drop(log);
            let all = read_all(&p).unwrap();
            assert_eq!(all.len(), 3);
            assert_eq!(all[2].seq, 3);
            assert_eq!(all[2].kind, "again");
        }
    }

    #[test]
    fn garbage_tail_is_cut() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.log");
        write_three(&p);
        let mut bytes = std::fs::read(&p).unwrap();
        let good = bytes.len() as u64;
        bytes.extend_from_slice(&[0u8; 100]);
        bytes.extend_from_slice(b"DSTR\xff\xff\xff\x7f");
        write_raw(&p, &bytes).unwrap();
        let (_log, opened) = LogFile::open(&p, FsyncPolicy::Never).unwrap();
        assert_eq!(opened.records.len(), 3);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), good);
    }

    #[test]
    fn crc_mismatch_in_the_last_record_is_cut() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.log");
        let pos = write_three(&p);
        let mut bytes = std::fs::read(&p).unwrap();
        let i = (pos[2].offset + HEADER as u64 + 3) as usize;
        bytes[i] ^= 0x20;
        write_raw(&p, &bytes).unwrap();
        let s = scan(&bytes);
        assert_eq!(s.bad.as_ref().map(|b| &b.1), Some(&FrameError::CrcMismatch));
        let (_log, opened) = LogFile::open(&p, FsyncPolicy::Never).unwrap();
        assert_eq!(opened.records.len(), 2);
        assert_eq!(opened.cut_bytes, pos[2].len as u64);
    }

    #[test]
    fn crc_mismatch_inside_is_refused_not_cut() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.log");
        let pos = write_three(&p);
        let mut bytes = std::fs::read(&p).unwrap();
        let i = (pos[1].offset + HEADER as u64 + 5) as usize;
        bytes[i] ^= 0x01;
        write_raw(&p, &bytes).unwrap();
        match LogFile::open(&p, FsyncPolicy::Never) {
            Err(OpenLogError::Corrupt { offset, why, .. }) => {
                assert_eq!(offset, pos[1].offset);
                assert_eq!(why, FrameError::CrcMismatch);
            }
            other => panic!(
                "expected Corrupt, got {:?}",
                other.map(|(_, o)| o.records.len())
            ),
        }
        assert_eq!(
            std::fs::read(&p).unwrap(),
            bytes,
            "a corrupt log is left as is"
        );
        // A reader still gets the valid prefix only.
        assert_eq!(read_all(&p).unwrap().len(), 1);
    }

    #[test]
    fn out_of_order_seq_is_bad() {
        let mut a = rec("x");
        a.seq = 1;
        let mut b = rec("y");
        b.seq = 5;
        let mut bytes = encode_frame(&serde_json::to_vec(&a).unwrap());
        let first = bytes.len() as u64;
        bytes.extend(encode_frame(&serde_json::to_vec(&b).unwrap()));
        let s = scan(&bytes);
        assert_eq!(s.records.len(), 1);
        assert_eq!(s.valid_len, first);
        assert!(s.bad.unwrap().1.to_string().contains("seq 5"));
    }
}
