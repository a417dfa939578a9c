//! aether: the agent inside every sandbox.
//!
//! Started as PID 1 of a container with the edge channel on fd 3 (an inherited socket, never a
//! path inside the sandbox). Reads `Setup`, builds the sandbox ([`setup`]), answers `Ready`, then
//! serves requests until the channel closes or `Shutdown` arrives.

mod setup;

fn main() {}
