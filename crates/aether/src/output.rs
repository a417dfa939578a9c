//! Output bookkeeping: bounded capture and the end-of-command marker (pure logic).

/// Keeps the first `cap` bytes of a stream and counts the rest.
#[derive(Debug, Default)]
pub struct Capped {
    pub kept: Vec<u8>,
    pub cap: usize,
    pub total: u64,
    pub truncated: bool,
}

impl Capped {
    pub fn new(cap: usize) -> Self {
        Capped {
            kept: Vec::new(),
            cap,
            total: 0,
            truncated: false,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.total += data.len() as u64;
        let room = self.cap.saturating_sub(self.kept.len());
        if data.len() > room {
            self.truncated = true;
        }
        let take = room.min(data.len());
        self.kept.extend_from_slice(&data[..take]);
    }
}

/// Result of feeding bytes to a [`MarkerScanner`].
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// Bytes of command output (marker bytes withheld until known not to be a marker).
    Output(Vec<u8>),
    /// Output that preceded the marker, then the exit status printed after it.
    Done(Vec<u8>, i32),
}

/// Finds `<marker><decimal status>\n` in a byte stream that arrives in arbitrary pieces.
/// Bytes that might be the start of a marker are held back until the next piece.
#[derive(Debug)]
pub struct MarkerScanner {
    marker: Vec<u8>,
    pending: Vec<u8>,
    done: bool,
}

/// Longest status text accepted after the marker ("-2147483648").
const MAX_STATUS_DIGITS: usize = 12;

impl MarkerScanner {
    pub fn new(marker: &[u8]) -> Self {
        MarkerScanner {
            marker: marker.to_vec(),
            pending: Vec::new(),
            done: false,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds the next bytes. After `Done` was returned further input is ignored.
    pub fn feed(&mut self, data: &[u8]) -> Scan {
        if self.done {
            return Scan::Output(Vec::new());
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(data);
        if let Some(i) = find(&buf, &self.marker) {
            let after = &buf[i + self.marker.len()..];
            if let Some(nl) = after.iter().position(|&b| b == b'\n') {
                let status = std::str::from_utf8(&after[..nl])
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(-1);
                self.done = true;
                buf.truncate(i);
                return Scan::Done(buf, status);
            }
            if after.len() > MAX_STATUS_DIGITS {
                // Not a well-formed marker after all; treat everything up to here as output.
                self.pending = Vec::new();
                return Scan::Output(buf);
            }
            self.pending = buf.split_off(i);
            return Scan::Output(buf);
        }
        // Hold back the longest suffix that is a prefix of the marker.
        let max = self.marker.len().saturating_sub(1).min(buf.len());
        let mut keep = 0;
        for k in (1..=max).rev() {
            if buf[buf.len() - k..] == self.marker[..k] {
                keep = k;
                break;
            }
        }
        self.pending = buf.split_off(buf.len() - keep);
        Scan::Output(buf)
    }

    /// Bytes held back when the stream ended without a marker.
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// First occurrence of `needle` in `hay`. Candidates are located with libc's memchr (this runs
/// over every byte a command prints, up to gigabytes).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, _) = needle.split_first()?;
    let mut from = 0;
    while hay.len() - from >= needle.len() {
        let rest = &hay[from..];
        // SAFETY: memchr reads at most `rest.len()` bytes from a valid slice.
        let p = unsafe { libc::memchr(rest.as_ptr().cast(), first as libc::c_int, rest.len()) };
        if p.is_null() {
            return None;
        }
        let i = from + (p as usize - rest.as_ptr() as usize);
        if hay.len() - i < needle.len() {
            return None;
        }
        if &hay[i..i + needle.len()] == needle {
            return Some(i);
        }
        from = i + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capping() {
        let mut c = Capped::new(5);
        c.push(b"abc");
        c.push(b"defgh");
        assert_eq!(c.kept, b"abcde");
        assert_eq!(c.total, 8);
        assert!(c.truncated);
        let mut c = Capped::new(3);
        c.push(b"abc");
        assert!(!c.truncated);
    }

    fn run(pieces: &[&[u8]]) -> (Vec<u8>, Option<i32>) {
        let mut s = MarkerScanner::new(b"\x1eMK1:");
        let mut out = Vec::new();
        for p in pieces {
            match s.feed(p) {
                Scan::Output(b) => out.extend(b),
                Scan::Done(b, st) => {
                    out.extend(b);
                    return (out, Some(st));
                }
            }
        }
        out.extend(s.flush());
        (out, None)
    }

    #[test]
    fn marker_whole_and_split() {
        assert_eq!(run(&[b"hello\x1eMK1:0\n"]), (b"hello".to_vec(), Some(0)));
        assert_eq!(
            run(&[b"no newline", b"\x1eMK", b"1:4", b"2\n"]),
            (b"no newline".to_vec(), Some(42))
        );
        // Every split point.
        let full: &[u8] = b"ab\x1ecd\x1eMK1:7\ntrailing";
        for i in 0..full.len() {
            assert_eq!(
                run(&[&full[..i], &full[i..]]),
                (b"ab\x1ecd".to_vec(), Some(7)),
                "split at {i}"
            );
        }
    }

    #[test]
    fn near_misses_pass_through() {
        assert_eq!(
            run(&[b"x\x1eMK", b"2:0\n"]),
            (b"x\x1eMK2:0\n".to_vec(), None)
        );
        assert_eq!(
            run(&[b"\x1eMK1:", b"123456789012345678"]),
            (b"\x1eMK1:123456789012345678".to_vec(), None)
        );
        assert_eq!(run(&[b"tail\x1eM"]), (b"tail\x1eM".to_vec(), None));
    }
}
