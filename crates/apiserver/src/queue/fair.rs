//! The order of the burst queue (pure data structure): FIFO by ticket within a project,
//! round-robin between the projects that have creates waiting.

use std::collections::{HashMap, VecDeque};

/// Waiting items by project; [`FairQueue::pop`] serves the projects in turn.
#[derive(Debug)]
pub struct FairQueue<T> {
    /// Per project, sorted by ticket (arrival order within the project).
    projects: HashMap<String, VecDeque<(u64, T)>>,
    /// Projects with waiting items, in the order they are served next.
    turn: VecDeque<String>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            projects: HashMap::new(),
            turn: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    /// Items waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Items of `project` waiting with a smaller ticket than `ticket`.
    pub fn ahead_of(&self, project: &str, ticket: u64) -> usize {
        self.projects
            .get(project)
            .map_or(0, |q| q.partition_point(|(t, _)| *t < ticket))
    }

    /// Adds `item` in ticket order. A new arrival (the largest ticket so far) goes to the back
    /// of its project; an item put back after an attempt that found no room goes back to its
    /// place (and, if its project had nothing waiting, its project is served next: it lost its
    /// turn to the lack of room, not to another project).
    pub fn push(&mut self, project: &str, ticket: u64, item: T, put_back: bool) {
        let q = self.projects.entry(project.to_string()).or_default();
        let was_empty = q.is_empty();
        let at = q.partition_point(|(t, _)| *t < ticket);
        q.insert(at, (ticket, item));
        self.len += 1;
        if was_empty {
            if put_back {
                self.turn.push_front(project.to_string());
            } else {
                self.turn.push_back(project.to_string());
            }
        }
    }

    /// The next item: the head of the project whose turn it is; that project goes to the back
    /// of the turn order if it still has items.
    pub fn pop(&mut self) -> Option<(String, u64, T)> {
        let project = self.turn.pop_front()?;
        let q = self.projects.get_mut(&project)?;
        let (ticket, item) = q.pop_front()?;
        self.len -= 1;
        if q.is_empty() {
            self.projects.remove(&project);
        } else {
            self.turn.push_back(project.clone());
        }
        Some((project, ticket, item))
    }

    /// The item [`FairQueue::pop`] would return next.
    pub fn peek(&self) -> Option<&T> {
        let project = self.turn.front()?;
        self.projects.get(project)?.front().map(|(_, item)| item)
    }

    /// Removes the item `ticket` of `project` (it gave up waiting); `None` if it is not here.
    pub fn remove(&mut self, project: &str, ticket: u64) -> Option<T> {
        let q = self.projects.get_mut(project)?;
        let at = q.binary_search_by_key(&ticket, |(t, _)| *t).ok()?;
        let (_, item) = q.remove(at)?;
        self.len -= 1;
        if q.is_empty() {
            self.projects.remove(project);
            self.turn.retain(|p| p != project);
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut FairQueue<()>) -> Vec<(String, u64)> {
        std::iter::from_fn(|| q.pop().map(|(p, t, _)| (p, t))).collect()
    }

    #[test]
    fn fifo_within_a_project_round_robin_between_projects() {
        let mut q = FairQueue::default();
        // Project a arrives with 6 creates before b's 2.
        for t in 0..6 {
            q.push("a", t, (), false);
        }
        q.push("b", 0, (), false);
        q.push("b", 1, (), false);
        assert_eq!(q.len(), 8);
        assert_eq!(q.ahead_of("a", 4), 4);
        let order = drain(&mut q);
        let names: Vec<&str> = order.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, ["a", "b", "a", "b", "a", "a", "a", "a"]);
        for p in ["a", "b"] {
            let tickets: Vec<u64> = order.iter().filter(|(x, _)| x == p).map(|o| o.1).collect();
            assert!(tickets.windows(2).all(|w| w[0] < w[1]), "{p}: {tickets:?}");
        }
        assert!(q.is_empty());
    }

    #[test]
    fn put_back_keeps_its_place_and_its_turn() {
        let mut q = FairQueue::default();
        for t in 0..3 {
            q.push("a", t, (), false);
            q.push("b", t, (), false);
        }
        assert!(q.peek().is_some());
        let (p, t, ()) = q.pop().unwrap();
        assert_eq!((p.as_str(), t), ("a", 0));
        // a/0 found no room: back before a/1 and a/2.
        q.push("a", 0, (), true);
        let order = drain(&mut q);
        let a: Vec<u64> = order
            .iter()
            .filter(|(p, _)| p == "a")
            .map(|o| o.1)
            .collect();
        assert_eq!(a, [0, 1, 2]);
        // A project with nothing else waiting is served next when its item comes back.
        let mut q = FairQueue::default();
        q.push("b", 0, (), false);
        q.push("b", 1, (), false);
        q.push("a", 7, (), true);
        assert_eq!(q.pop().unwrap().0, "a");
    }

    #[test]
    fn a_waiter_that_gives_up_leaves_nothing() {
        let mut q = FairQueue::default();
        q.push("a", 0, 10, false);
        q.push("a", 1, 11, false);
        q.push("b", 0, 20, false);
        assert_eq!(q.remove("a", 1), Some(11));
        assert_eq!(q.remove("a", 1), None);
        assert_eq!(q.remove("b", 0), Some(20));
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(), Some(("a".into(), 0, 10)));
        assert!(q.pop().is_none() && q.turn.is_empty() && q.projects.is_empty());
    }
}
