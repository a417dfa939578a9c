//! The byte relay between a VM's long-lived aether channel and the QEMU process of the moment.
//!
//! The edge's [`crate::aether_client::AetherClient`] of a microVM talks to one end of a socket
//! pair for the VM's whole life; the relay copies bytes between the other end (`edge`) and the
//! unix socket of the current QEMU process. A pause by snapshot ends QEMU and a resume starts a
//! new one: the relay of the old process is detached and a new one attached, so the client, its
//! calls in flight and the guest's aether (whose side of the stream lives in the snapshot) see
//! one uninterrupted byte stream.
//!
//! Bytes from the edge that QEMU had not yet read would die with the process: before the guest
//! is stopped, the pause waits until [`outq`] says QEMU's socket holds nothing unread (the
//! guest, still running, takes them); `pending` bytes given to [`Relay::start`] are sent first.

use super::error::VmError;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The most recent bytes written towards QEMU that are kept (more than a unix socket buffers).
const TAIL: usize = 4 << 20;

/// What the edge→guest half hands back when detached.
pub struct ToGuestEnd {
    pub edge_r: OwnedReadHalf,
    /// QEMU's socket (write half), kept open so its unread bytes can still be counted.
    pub qemu_w: OwnedWriteHalf,
    /// The last bytes written to `qemu_w` (up to [`TAIL`]).
    pub tail: Vec<u8>,
    /// The edge's end closed or a write to QEMU failed (the VM is gone).
    pub broken: bool,
}

/// A running relay.
pub struct Relay {
    detach: Option<oneshot::Sender<()>>,
    to_guest: JoinHandle<ToGuestEnd>,
    from_guest: JoinHandle<Option<OwnedWriteHalf>>,
}

impl Relay {
    /// Starts copying: first `pending` then everything from `edge_r` to QEMU, and everything
    /// from QEMU to `edge_w`. When QEMU's side ends and `intentional` is not set, the edge's
    /// write half is dropped, which the client sees as the end of its channel.
    pub fn start(
        edge_r: OwnedReadHalf,
        edge_w: OwnedWriteHalf,
        qemu: UnixStream,
        pending: Vec<u8>,
        intentional: Arc<AtomicBool>,
    ) -> Relay {
        let (qemu_r, qemu_w) = qemu.into_split();
        let (tx, rx) = oneshot::channel();
        Relay {
            detach: Some(tx),
            to_guest: tokio::spawn(to_guest(edge_r, qemu_w, pending, rx)),
            from_guest: tokio::spawn(from_guest(qemu_r, edge_w, intentional)),
        }
    }

    /// Stops copying towards QEMU (after the write in progress) and returns that half.
    pub async fn detach(&mut self) -> Result<ToGuestEnd, VmError> {
        if let Some(tx) = self.detach.take() {
            let _ = tx.send(());
        }
        (&mut self.to_guest).await.map_err(VmError::RelayTask)
    }

    /// Restarts copying towards QEMU after [`Relay::detach`] (a pause that failed half-way).
    pub fn reattach(&mut self, end: ToGuestEnd) {
        let (tx, rx) = oneshot::channel();
        self.detach = Some(tx);
        self.to_guest = tokio::spawn(to_guest(end.edge_r, end.qemu_w, Vec::new(), rx));
    }

    /// Waits for QEMU's side to end (QEMU exited) and returns the edge's write half, unless the
    /// end was not intentional (then it was dropped).
    pub async fn finish(self) -> Result<Option<OwnedWriteHalf>, VmError> {
        self.from_guest.await.map_err(VmError::RelayTask)
    }

    /// Whether the QEMU→edge half has ended.
    pub fn from_guest_done(&self) -> bool {
        self.from_guest.is_finished()
    }
}

async fn to_guest(
    mut edge_r: OwnedReadHalf,
    mut qemu_w: OwnedWriteHalf,
    pending: Vec<u8>,
    mut detach: oneshot::Receiver<()>,
) -> ToGuestEnd {
    let mut tail: Vec<u8> = Vec::new();
    let mut broken = false;
    if !pending.is_empty() {
        if qemu_w.write_all(&pending).await.is_err() {
            broken = true;
        }
        keep_tail(&mut tail, &pending);
    }
    let mut buf = vec![0u8; 64 * 1024];
    while !broken {
        tokio::select! {
            biased;
            _ = &mut detach => break,
            r = edge_r.read(&mut buf) => match r {
                Ok(0) | Err(_) => broken = true,
                Ok(n) => {
                    if qemu_w.write_all(&buf[..n]).await.is_err() {
                        broken = true;
                    }
                    keep_tail(&mut tail, &buf[..n]);
                }
            },
        }
    }
    ToGuestEnd {
        edge_r,
        qemu_w,
        tail,
        broken,
    }
}

fn keep_tail(tail: &mut Vec<u8>, add: &[u8]) {
    tail.extend_from_slice(add);
    if tail.len() > TAIL {
        let cut = tail.len() - TAIL;
        tail.drain(..cut);
    }
}

async fn from_guest(
    mut qemu_r: OwnedReadHalf,
    mut edge_w: OwnedWriteHalf,
    intentional: Arc<AtomicBool>,
) -> Option<OwnedWriteHalf> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match qemu_r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if edge_w.write_all(&buf[..n]).await.is_err() {
                    // The edge dropped its client: nothing to keep.
                    return None;
                }
            }
        }
    }
    if intentional.load(Ordering::SeqCst) {
        Some(edge_w)
    } else {
        None
    }
}

/// Memory held by bytes written to `sock` that its peer has not read yet (`SIOCOUTQ`; for unix
/// sockets in allocation units, not bytes: only `0` — nothing unread — is exact).
pub fn outq(sock: &OwnedWriteHalf) -> std::io::Result<usize> {
    let stream: &UnixStream = sock.as_ref();
    let fd = stream.as_raw_fd();
    let mut n: libc::c_int = 0;
    // SAFETY: ioctl(SIOCOUTQ == TIOCOUTQ) on a valid socket fd (borrowed from a live stream)
    // writes one int to the pointer, which points at a local c_int.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stream_survives_a_switch_of_qemu_side() {
        let (client, edge) = UnixStream::pair().unwrap();
        let (edge_r, edge_w) = edge.into_split();
        let (q1, mut guest1) = UnixStream::pair().unwrap();
        let intentional = Arc::new(AtomicBool::new(false));
        let mut relay = Relay::start(edge_r, edge_w, q1, Vec::new(), intentional.clone());
        let (mut cr, mut cw) = client.into_split();
        cw.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        guest1.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hello");
        guest1.write_all(b"world").await.unwrap();
        cr.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"world");
        // Pause: detach; bytes still unread by the "guest" show in outq until it reads them.
        let mut end = relay.detach().await.unwrap();
        assert!(!end.broken);
        assert!(outq(&end.qemu_w).unwrap() == 0);
        end.qemu_w.write_all(b"abc").await.unwrap();
        assert!(outq(&end.qemu_w).unwrap() > 0);
        let mut b3 = [0u8; 3];
        guest1.read_exact(&mut b3).await.unwrap();
        assert_eq!(outq(&end.qemu_w).unwrap(), 0);
        intentional.store(true, Ordering::SeqCst);
        // Written by the client while paused: waits in the socket pair.
        cw.write_all(b"later").await.unwrap();
        drop(end.qemu_w);
        drop(guest1);
        let edge_w = relay
            .finish()
            .await
            .unwrap()
            .expect("intentional end keeps the edge half");
        // Resume with a new "QEMU".
        intentional.store(false, Ordering::SeqCst);
        let (q2, mut guest2) = UnixStream::pair().unwrap();
        let relay2 = Relay::start(end.edge_r, edge_w, q2, b"p".to_vec(), intentional.clone());
        let mut b6 = [0u8; 6];
        guest2.read_exact(&mut b6).await.unwrap();
        assert_eq!(&b6, b"plater");
        // QEMU dies: the client's channel ends.
        drop(guest2);
        assert!(relay2.finish().await.unwrap().is_none());
        let mut rest = Vec::new();
        cr.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }
}
