//! Frames on the edge channel: one reader (the main thread), one writer shared behind a mutex so
//! that whole frames never interleave.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use dsec_wire::aether::{self, Envelope, Msg, Reply, Request, CHUNK, MAX_BODY};

use crate::sys;

/// What came in on the channel. (Short-lived, one at a time: boxing the request buys nothing.)
#[allow(clippy::large_enum_variant)]
pub enum Incoming {
    Request(u64, Request, Vec<u8>),
    /// A frame with a valid header shape but a request we cannot decode.
    Bad(u64, String),
}

/// Why the channel ended.
#[derive(Debug)]
pub enum ReadError {
    Eof,
    Io(io::Error),
    Malformed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Eof => f.write_str("end of stream"),
            ReadError::Io(e) => write!(f, "read: {e}"),
            ReadError::Malformed(m) => write!(f, "malformed frame: {m}"),
        }
    }
}

fn read_exact(fd: RawFd, buf: &mut [u8]) -> Result<(), ReadError> {
    let mut done = 0;
    while done < buf.len() {
        match sys::read(fd, &mut buf[done..]) {
            Ok(0) => return Err(ReadError::Eof),
            Ok(n) => done += n,
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

/// Reads one frame.
pub fn read_frame(fd: RawFd) -> Result<Incoming, ReadError> {
    let mut prefix = [0u8; 8];
    read_exact(fd, &mut prefix)?;
    let (hlen, blen) =
        aether::parse_prefix(prefix).map_err(|e| ReadError::Malformed(e.to_string()))?;
    let mut header = vec![0u8; hlen];
    read_exact(fd, &mut header)?;
    let mut body = vec![0u8; blen];
    read_exact(fd, &mut body)?;
    match aether::parse_header(&header) {
        Ok(Envelope {
            id,
            msg: Msg::Request(req),
        }) => Ok(Incoming::Request(id, req, body)),
        Ok(Envelope {
            id,
            msg: Msg::Reply(_),
        }) => Ok(Incoming::Bad(id, "aether accepts requests only".into())),
        Err(e) => {
            // A JSON object with an id is a request we do not understand; anything else is noise.
            let v: serde_json::Value =
                serde_json::from_slice(&header).map_err(|_| ReadError::Malformed(e.to_string()))?;
            match v.get("id").and_then(|i| i.as_u64()) {
                Some(id) => Ok(Incoming::Bad(id, e.to_string())),
                None => Err(ReadError::Malformed(e.to_string())),
            }
        }
    }
}

/// The sending half. Failed writes are ignored: the reader notices the broken channel.
pub struct Writer {
    fd: Mutex<Option<OwnedFd>>,
}

impl Writer {
    pub fn new(fd: OwnedFd) -> Self {
        Writer {
            fd: Mutex::new(Some(fd)),
        }
    }

    /// Replaces the channel (after a reattach).
    pub fn replace(&self, fd: OwnedFd) {
        *self.fd.lock().unwrap_or_else(|p| p.into_inner()) = Some(fd);
    }

    /// Sends one frame; false if the channel is broken.
    pub fn send(&self, id: u64, reply: Reply, body: &[u8]) -> bool {
        debug_assert!(body.len() <= MAX_BODY as usize);
        let frame = aether::encode_frame(
            &Envelope {
                id,
                msg: Msg::Reply(reply),
            },
            body,
        );
        let g = self.fd.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_ref() {
            Some(fd) => sys::write_all(fd.as_raw_fd(), &frame).is_ok(),
            None => false,
        }
    }

    /// Sends a terminal reply whose body may exceed one frame ([`MAX_BODY`]): then the leading
    /// part goes out in `Data` frames of [`CHUNK`] bytes and the last piece with `reply` itself
    /// (receivers concatenate `Data` bodies and the terminal body).
    pub fn send_long(&self, id: u64, reply: Reply, body: &[u8]) -> bool {
        if body.len() <= MAX_BODY as usize {
            return self.send(id, reply, body);
        }
        let mut rest = body;
        while rest.len() > CHUNK {
            if !self.send(id, Reply::Data, &rest[..CHUNK]) {
                return false;
            }
            rest = &rest[CHUNK..];
        }
        self.send(id, reply, rest)
    }

    pub fn error(
        &self,
        id: u64,
        kind: aether::AetherErrorKind,
        message: impl Into<String>,
    ) -> bool {
        self.send(
            id,
            Reply::Error(aether::AetherError {
                kind,
                message: message.into(),
            }),
            &[],
        )
    }
}
