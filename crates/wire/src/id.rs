//! Sandbox ids encode the owning node so any apiserver can route a call without a lookup.
//!
//! Format: `sb-<node>-<random>` where `<node>` is `[a-z0-9]{1,16}` and `<random>` is 16 hex
//! characters. Example: `sb-n0-3f9a2c01d4e5b6a7`.

/// Builds a sandbox id from a node id and 64 random bits.
pub fn make_sandbox_id(node: &str, random: u64) -> String {
    format!("sb-{node}-{random:016x}")
}

/// Returns the node id encoded in a sandbox id, or `None` if the id is malformed.
pub fn node_of(sandbox_id: &str) -> Option<&str> {
    let rest = sandbox_id.strip_prefix("sb-")?;
    let (node, random) = rest.rsplit_once('-')?;
    let node_ok = !node.is_empty()
        && node.len() <= 16
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let random_ok = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    (node_ok && random_ok).then_some(node)
}

/// True when `s` is a well-formed sandbox id. Ids are also used as directory and cgroup
/// names, so anything else must be rejected before touching the file system.
pub fn is_valid_sandbox_id(s: &str) -> bool {
    node_of(s).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id = make_sandbox_id("n0", 0x3f9a_2c01_d4e5_b6a7);
        assert_eq!(id, "sb-n0-3f9a2c01d4e5b6a7");
        assert_eq!(node_of(&id), Some("n0"));
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "sb-",
            "sb-n0-",
            "sb-n0-xyz",
            "sb-../..-0000000000000000",
            "n0-3f9a2c01d4e5b6a7",
            "sb-N0-3f9a2c01d4e5b6a7",
        ] {
            assert!(!is_valid_sandbox_id(bad), "{bad}");
        }
    }
}
