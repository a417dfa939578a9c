//! The edge's side of the trajectory log ([`dsec_trajectory`]): the log typed with the edge's
//! error, and [`hooks`], the glue that records the manager's calls.

pub mod hooks;

pub use dsec_trajectory::*;

/// Every trajectory log of the node; a failed call is recorded (and answered again) as an
/// [`EdgeError`](crate::EdgeError).
pub type Trajectories = dsec_trajectory::Trajectories<crate::EdgeError>;
