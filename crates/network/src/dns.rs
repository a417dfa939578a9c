//! The edge's DNS proxy: answers a sandbox only names its policy allows, from the static
//! host table of the edge config, and adds every address it hands out to that sandbox's allow
//! set for the record's TTL. Everything else is refused (`REFUSED`) and counted.
//!
//! Message handling is pure (parse a question, build an answer) and unit-tested; the server
//! is one UDP socket on the gateway address, identifying the sandbox by source address.

use std::net::IpAddr;

use crate::error::PolicyError;

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;
pub const RCODE_FORMERR: u8 = 1;

/// A parsed question.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired bit, echoed back.
    pub rd: bool,
    /// Lower case, without the trailing dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// The raw question section (echoed in the answer).
    pub question: Vec<u8>,
}

/// Parses a standard query with exactly one question; `Err` carries the id for a FORMERR.
pub fn parse_query(msg: &[u8]) -> Result<Query, Option<u16>> {
    if msg.len() < 12 {
        return Err(None);
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let flags = u16::from_be_bytes([msg[2], msg[3]]);
    let qr = flags & 0x8000 != 0;
    let opcode = (flags >> 11) & 0xf;
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    if qr || opcode != 0 || qd != 1 {
        return Err(Some(id));
    }
    let mut pos = 12;
    let mut labels: Vec<String> = Vec::new();
    let mut total = 0usize;
    loop {
        let len = *msg.get(pos).ok_or(Some(id))? as usize;
        pos += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return Err(Some(id)); // compression pointers are not valid in a question we accept
        }
        let label = msg.get(pos..pos + len).ok_or(Some(id))?;
        total += len + 1;
        if total > 255 {
            return Err(Some(id));
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        pos += len;
    }
    let tail = msg.get(pos..pos + 4).ok_or(Some(id))?;
    let qtype = u16::from_be_bytes([tail[0], tail[1]]);
    let qclass = u16::from_be_bytes([tail[2], tail[3]]);
    Ok(Query {
        id,
        rd: flags & 0x0100 != 0,
        name: labels.join("."),
        qtype,
        qclass,
        question: msg[12..pos + 4].to_vec(),
    })
}

/// Builds an answer: `rcode` and the given addresses (those matching the query type).
pub fn build_answer(q: &Query, rcode: u8, addrs: &[IpAddr], ttl: u32) -> Vec<u8> {
    let answers: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| {
            matches!(
                (a, q.qtype),
                (IpAddr::V4(_), TYPE_A) | (IpAddr::V6(_), TYPE_AAAA)
            )
        })
        .collect();
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&q.id.to_be_bytes());
    // QR=1, AA=1, RD echoed, RA=1.
    let flags: u16 =
        0x8000 | 0x0400 | if q.rd { 0x0100 } else { 0 } | 0x0080 | u16::from(rcode & 0xf);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&q.question);
    for a in answers {
        out.extend_from_slice(&[0xc0, 0x0c]); // pointer to the question's name
        let (ty, data): (u16, Vec<u8>) = match a {
            IpAddr::V4(v) => (TYPE_A, v.octets().to_vec()),
            IpAddr::V6(v) => (TYPE_AAAA, v.octets().to_vec()),
        };
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&1u16.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    out
}

/// A FORMERR for an unparseable message that at least had an id.
pub fn build_formerr(id: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&(0x8000u16 | u16::from(RCODE_FORMERR)).to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    out
}

/// Looks `name` up in the static table: exact names first, then `*.suffix` entries.
pub fn lookup<'a>(hosts: &'a [(String, Vec<IpAddr>)], name: &str) -> Option<&'a [IpAddr]> {
    hosts
        .iter()
        .find(|(n, _)| n == name)
        .or_else(|| {
            hosts
                .iter()
                .find(|(n, _)| crate::policy::pattern_matches(n, name))
        })
        .map(|(_, a)| a.as_slice())
}

/// Parses the config's `hosts` values: one address or several separated by commas.
pub fn parse_addrs(s: &str) -> Result<Vec<IpAddr>, PolicyError> {
    s.split(',')
        .map(|a| {
            a.trim()
                .parse::<IpAddr>()
                .map_err(|_| PolicyError::HostAddress(a.into()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(a: &str) -> IpAddr {
        IpAddr::V4(a.parse::<Ipv4Addr>().unwrap())
    }

    fn v6(a: &str) -> IpAddr {
        IpAddr::V6(a.parse::<Ipv6Addr>().unwrap())
    }

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend_from_slice(l.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m
    }

    #[test]
    fn roundtrip() {
        let q = parse_query(&query("Files.PyPI.test", TYPE_A)).unwrap();
        assert_eq!(q.name, "files.pypi.test");
        assert_eq!((q.id, q.qtype, q.rd), (0x1234, TYPE_A, true));
        let a = build_answer(&q, 0, &[v4("192.0.2.10"), v6("fd01::1")], 30);
        assert_eq!(&a[0..2], &[0x12, 0x34]);
        assert_eq!(a[3] & 0xf, 0);
        assert_eq!(
            u16::from_be_bytes([a[6], a[7]]),
            1,
            "only the A record answers an A query"
        );
        assert_eq!(&a[a.len() - 4..], &[192, 0, 2, 10]);
        let r = build_answer(&q, RCODE_REFUSED, &[], 0);
        assert_eq!(r[3] & 0xf, RCODE_REFUSED);
        assert_eq!(r.len(), 12 + q.question.len());
    }

    #[test]
    fn malformed() {
        assert_eq!(parse_query(&[1, 2, 3]), Err(None));
        let mut m = query("a.test", TYPE_A);
        m[2] |= 0x80; // a response, not a query
        assert_eq!(parse_query(&m), Err(Some(0x1234)));
        let mut m = query("a.test", TYPE_A);
        m.truncate(m.len() - 2);
        assert_eq!(parse_query(&m), Err(Some(0x1234)));
        let mut m = query("a.test", TYPE_A);
        m[12] = 0xc0; // compression pointer
        assert!(parse_query(&m).is_err());
        assert_eq!(build_formerr(7)[3] & 0xf, RCODE_FORMERR);
    }

    #[test]
    fn table() {
        let hosts = vec![
            ("pypi.test".to_string(), vec![v4("192.0.2.10")]),
            ("*.pypi.test".to_string(), vec![v4("192.0.2.11")]),
        ];
        assert_eq!(lookup(&hosts, "pypi.test"), Some(&[v4("192.0.2.10")][..]));
        assert_eq!(
            lookup(&hosts, "files.pypi.test"),
            Some(&[v4("192.0.2.11")][..])
        );
        assert_eq!(lookup(&hosts, "npm.test"), None);
        assert_eq!(parse_addrs("192.0.2.1, fd00::1").unwrap().len(), 2);
        assert!(parse_addrs("nope").is_err());
    }
}
