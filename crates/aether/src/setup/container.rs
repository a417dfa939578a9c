//! Container setup inside aether. See the module docs of [`crate::setup`].

use dsec_wire::aether::ContainerSetup;

/// Why the sandbox could not be set up; sent to the edge as a `Setup` error.
#[derive(Debug)]
pub struct SetupError(pub String);

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Builds the sandbox's root and restrictions. Called once, before serving.
pub fn apply(_setup: &ContainerSetup) -> Result<(), SetupError> {
    Err(SetupError("container setup is not implemented yet".into()))
}
