//! Endpoints that speak other code-execution services' APIs, translated onto dsec's own.

pub mod e2b;
pub mod sandboxfusion;
