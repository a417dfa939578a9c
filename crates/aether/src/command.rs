//! Collecting a command's output: bounded capture, optional streaming, optional end markers,
//! and the poll loop shared by `Exec` and chronus sessions.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use dsec_wire::aether::{CommandOutcome, Reply, Stream};

use crate::channel::Writer;
use crate::output::{Capped, MarkerScanner, Scan};
use crate::sys;

/// Upper bound of kept bytes per stream, whatever the request asks (the API's maximum).
pub const MAX_KEPT: u64 = 64 * 1024 * 1024;
const READ_BUF: usize = 64 * 1024;

/// Why [`Collector::pump`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Both end markers were seen.
    Markers,
    /// The watched process exited.
    Exited,
    Deadline,
    Cancelled,
    /// Both pipes reached EOF and there is no process to watch.
    Eof,
}

pub struct Collector<'a> {
    w: &'a Writer,
    id: u64,
    stream: bool,
    pub out: Capped,
    pub err: Capped,
    scanners: Option<[MarkerScanner; 2]>,
    /// Status printed after the stdout marker.
    pub marker_status: Option<i32>,
    /// Open read ends of stdout and stderr.
    fds: [Option<RawFd>; 2],
    buf: Vec<u8>,
}

impl<'a> Collector<'a> {
    pub fn new(
        w: &'a Writer,
        id: u64,
        stream: bool,
        max_output: u64,
        fds: [RawFd; 2],
        marker: Option<&[u8]>,
    ) -> Self {
        let cap = max_output.min(MAX_KEPT) as usize;
        Collector {
            w,
            id,
            stream,
            out: Capped::new(cap),
            err: Capped::new(cap),
            scanners: marker.map(|m| [MarkerScanner::new(m), MarkerScanner::new(m)]),
            marker_status: None,
            fds: [Some(fds[0]), Some(fds[1])],
            buf: vec![0u8; READ_BUF],
        }
    }

    fn emit(&mut self, idx: usize, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if self.stream {
            let stream = if idx == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            self.w.send(self.id, Reply::Output { stream }, data);
        }
        if idx == 0 {
            &mut self.out
        } else {
            &mut self.err
        }
        .push(data);
    }

    /// One read from stream `idx`; closes it on EOF or error.
    fn read_one(&mut self, idx: usize) {
        let Some(fd) = self.fds[idx] else { return };
        let n = match sys::read(fd, &mut self.buf) {
            Ok(0) | Err(_) => {
                self.fds[idx] = None;
                if let Some(sc) = self.scanners.as_mut() {
                    let rest = sc[idx].flush();
                    self.emit(idx, &rest);
                }
                return;
            }
            Ok(n) => n,
        };
        let data = std::mem::take(&mut self.buf);
        match self.scanners.as_mut() {
            None => self.emit(idx, &data[..n]),
            Some(sc) => match sc[idx].feed(&data[..n]) {
                Scan::Output(b) => self.emit(idx, &b),
                Scan::Done(b, st) => {
                    if idx == 0 {
                        self.marker_status = Some(st);
                    }
                    self.emit(idx, &b);
                }
            },
        }
        self.buf = data;
    }

    fn markers_done(&self) -> bool {
        self.scanners
            .as_ref()
            .is_some_and(|s| s[0].is_done() && s[1].is_done())
    }

    /// Reads output until the markers are seen, `pidfd` becomes readable, `deadline` passes or
    /// `cancel` fires.
    pub fn pump(
        &mut self,
        pidfd: Option<RawFd>,
        cancel: Option<RawFd>,
        deadline: Option<Instant>,
    ) -> Stop {
        loop {
            if self.markers_done() {
                return Stop::Markers;
            }
            let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(4);
            let mut idxs = Vec::with_capacity(2);
            for (i, fd) in self.fds.iter().enumerate() {
                // Stop reading a stream whose marker was already seen: what follows belongs to
                // background jobs and stays in the pipe.
                let scanned = self.scanners.as_ref().is_some_and(|s| s[i].is_done());
                if let (Some(fd), false) = (fd, scanned) {
                    pfds.push(libc::pollfd {
                        fd: *fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    idxs.push(i);
                }
            }
            let npipes = pfds.len();
            if npipes == 0 && pidfd.is_none() {
                return Stop::Eof;
            }
            if let Some(p) = pidfd {
                pfds.push(libc::pollfd {
                    fd: p,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            let cancel_at = pfds.len();
            if let Some(c) = cancel {
                pfds.push(libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            let timeout = match deadline {
                None => -1,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Stop::Deadline;
                    }
                    (d - now).as_millis().min(i32::MAX as u128) as i32 + 1
                }
            };
            if sys::poll(&mut pfds, timeout).is_err() {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            for k in 0..npipes {
                if pfds[k].revents != 0 {
                    self.read_one(idxs[k]);
                }
            }
            if cancel.is_some() && pfds[cancel_at].revents != 0 {
                return Stop::Cancelled;
            }
            if pidfd.is_some() && pfds[npipes].revents != 0 {
                return Stop::Exited;
            }
        }
    }

    /// After the process exited: reads what is left until both pipes hit EOF (or the markers
    /// are seen), giving up at `until` (a background child may hold the pipes open).
    pub fn drain(&mut self, until: Instant) {
        while self.fds.iter().any(|f| f.is_some()) && !self.markers_done() {
            if self.pump(None, None, Some(until)) != Stop::Markers && Instant::now() >= until {
                break;
            }
        }
    }

    /// Sends `CommandDone` with the kept output as body.
    pub fn finish(self, mut outcome: CommandOutcome, started: Instant) {
        outcome.stdout_len = self.out.kept.len() as u64;
        outcome.stderr_len = self.err.kept.len() as u64;
        outcome.stdout_total = self.out.total;
        outcome.stderr_total = self.err.total;
        outcome.stdout_truncated = self.out.truncated;
        outcome.stderr_truncated = self.err.truncated;
        outcome.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        let mut body = self.out.kept;
        body.extend_from_slice(&self.err.kept);
        self.w
            .send_long(self.id, Reply::CommandDone(outcome), &body);
    }
}

/// Feeds `body` to a pipe's write end on a small thread (so a command that does not read its
/// stdin cannot block us). The pipe closes when everything was written.
pub fn feed_stdin(fd: std::os::fd::OwnedFd, body: Vec<u8>) {
    let spawned = std::thread::Builder::new()
        .name("stdin".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            use std::os::fd::AsRawFd;
            let _ = sys::write_all(fd.as_raw_fd(), &body);
        });
    if let Err(e) = spawned {
        eprintln!("aether: stdin feeder: {e}");
    }
}
