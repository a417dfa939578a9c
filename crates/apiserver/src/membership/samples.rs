//! Samples of the membership wire types (every field set) for the OpenAPI document's tests.

use dsec_wire::api::{
    DrainPolicy, DrainRequest, JoinAnswer, JoinRequest, JoinToken, NodeAction, NodeMembership,
    NodePool, NodeState,
};
use serde_json::Value;

fn ser<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).expect("serialize sample")
}

pub fn membership() -> NodeMembership {
    NodeMembership {
        state: NodeState::Suspect,
        pool: NodePool::Overflow,
        joined: true,
        last_heartbeat_ms: Some(1),
        last_seen_ms: Some(2),
        detail: Some("no heartbeat".into()),
    }
}

pub fn add_samples(add: &mut impl FnMut(&'static str, Value)) {
    for s in [
        NodeState::Healthy,
        NodeState::Suspect,
        NodeState::Lost,
        NodeState::Cordoned,
        NodeState::Draining,
        NodeState::Drained,
    ] {
        add("NodeState", ser(s));
    }
    for p in [NodePool::Primary, NodePool::Overflow] {
        add("NodePool", ser(p));
    }
    for p in [DrainPolicy::Pause, DrainPolicy::Stop] {
        add("DrainPolicy", ser(p));
    }
    add("NodeMembership", ser(membership()));
    add(
        "JoinRequest",
        ser(JoinRequest {
            node_id: "n1".into(),
            url: "http://n1.dsec.test:7481".into(),
            token: "t".into(),
            capacity: 10,
            pool: NodePool::Overflow,
            labels: [("zone".to_string(), "a".to_string())].into(),
        }),
    );
    add(
        "JoinAnswer",
        ser(JoinAnswer {
            node_id: "n1".into(),
            state: NodeState::Healthy,
            heartbeat_period_ms: 1000,
        }),
    );
    add(
        "DrainRequest",
        ser(DrainRequest {
            policy: DrainPolicy::Stop,
        }),
    );
    add(
        "NodeAction",
        ser(NodeAction {
            node_id: "n1".into(),
            state: NodeState::Drained,
            paused: vec!["sb-n1-0000000000000001".into()],
            stopped: vec!["sb-n1-0000000000000002".into()],
            failed: [("sb-n1-0000000000000003".to_string(), "gone".to_string())].into(),
        }),
    );
    add(
        "JoinToken",
        ser(JoinToken {
            token: "dsj_x".into(),
        }),
    );
}
