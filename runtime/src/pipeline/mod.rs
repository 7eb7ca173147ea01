//! Running one stage of a pipeline across ranks: the schedules (pure action lists) and their
//! execution over c10d.

pub mod schedule;
