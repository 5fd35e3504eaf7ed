//! The MPI collective on its own: every rank sums vectors of several sizes
//! (empty, small, and larger than the shared-memory window held so far, so
//! that it grows) in place and out of place, and checks the bits against
//! the sum in rank order, and gathers values of a length of each rank's
//! own. Run it under MPI:
//!
//! `cargo build --release -p voltaic --features mpi --example mpi_collective`
//! then `mpirun -np 3 --bind-to none target/release/examples/mpi_collective`
//! (`VOLTAIC_MPI_SHARED=0` checks `MPI_Allreduce` instead of the shared
//! window; its sums are Open MPI's, so only closeness is checked there).
use voltaic::distributed::{Collective, MpiCollective};

fn value(rank: usize, i: usize, round: usize) -> f32 {
    ((i * 31 + rank * 17 + round * 7) % 1013) as f32 * 1e-3 + rank as f32 * 1e-7
}

fn main() -> voltaic::Result<()> {
    let comm = MpiCollective::world()?;
    let (rank, n) = (comm.rank(), comm.world_size());
    let exact = !std::env::var("VOLTAIC_MPI_SHARED").is_ok_and(|v| v == "0");
    let sizes = [0, 1, 1000, (1 << 20) + 3, 5, (3 << 20) + 1, 17];
    for (round, &len) in sizes.iter().enumerate() {
        let want: Vec<f32> = (0..len).map(|i| (0..n).fold(0f32, |s, r| s + value(r, i, round))).collect();
        let mine: Vec<f32> = (0..len).map(|i| value(rank, i, round)).collect();
        let mut inplace = mine.clone();
        comm.all_reduce_sum(&mut inplace)?;
        let mut out = vec![f32::NAN; len];
        comm.all_reduce_sum_into(&mine, &mut out)?;
        for (what, got) in [("in place", &inplace), ("out of place", &out)] {
            for i in 0..len {
                let ok = if exact { got[i].to_bits() == want[i].to_bits() } else { (got[i] - want[i]).abs() <= 1e-5 * want[i].abs().max(1.0) };
                if !ok {
                    eprintln!("rank {rank}: {len} values {what}: element {i} is {} against {}", got[i], want[i]);
                    std::process::exit(1);
                }
            }
        }
    }
    // Gathers of a length of each rank's own (rank 1 brings none): every
    // rank sees every rank's values, to the bit (adding zeros keeps them).
    for round in 0..3 {
        let len = |r: usize| if r == 1 { 0 } else { 1000 * r + 7 + round * 50_000 };
        let mine: Vec<f32> = (0..len(rank)).map(|i| value(rank, i, round)).collect();
        comm.all_gather_f32(&mine, &mut |parts| {
            for (r, part) in parts.iter().enumerate() {
                if part.len() != len(r) || part.iter().enumerate().any(|(i, x)| x.to_bits() != value(r, i, round).to_bits()) {
                    eprintln!("rank {rank}: gather {round}: rank {r}'s {} values differ from the {} it sent", part.len(), len(r));
                    std::process::exit(1);
                }
            }
            Ok(())
        })?;
    }
    println!("rank {rank} of {n}: {} sizes summed {}, 3 gathers exact", sizes.len(), if exact { "to the bit" } else { "within 1e-5" });
    Ok(())
}
