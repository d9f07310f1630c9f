"""Your own network and training loop, on dimd's in-memory data and its overlapped gradient allreduce.

    mpiexec -n 2 python examples/own_loop.py TRAIN --val VAL [--epochs N] [--batch-size B] [--lr LR] [--json PATH]

TRAIN and VAL are packed sets (``dimd pack``). Everything but three calls is
plain PyTorch; ``dimd train --model examples/own_loop.py:small_cnn`` trains
the same network with dimd's own loop (docs/library.md).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import dimd


def small_cnn(num_classes: int) -> nn.Module:
    """Three convolutions with batch norm, global pooling, one linear layer."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train")
    parser.add_argument("--val", required=True)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()

    comm, device = dimd.init()          # MPI, threads and device per rank; one failing rank ends the job
    train = dimd.open_loader(args.train, comm, args.batch_size, image_size=args.image_size, crop_scale=0.35)
    val = dimd.open_loader(args.val, comm, args.batch_size, image_size=args.image_size, train=False)
    normalize = dimd.Normalize(device)  # uint8 batches -> normalised float on the device
    torch.manual_seed(0)
    model = small_cnn(len(train.store.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dimd.DistributedGradients(model, optimizer=optimizer)   # rank 0's weights; backward() averages .grad

    images, seconds, top1 = 0, 0.0, 0.0
    for epoch in range(args.epochs):
        model.train()
        started = time.perf_counter()
        for x, y in train.epoch(epoch):
            loss = F.cross_entropy(model(normalize(x)), y.to(device))
            optimizer.zero_grad()
            loss.backward()             # full buckets are summed over the ranks meanwhile
            optimizer.step()
            images += len(y) * comm.Get_size()
        seconds += time.perf_counter() - started
        model.eval()
        counts = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val.epoch(0):   # each rank scores its share of the validation set
                counts += torch.tensor([float((model(normalize(x)).argmax(1).cpu() == y).sum()), len(y)])
        correct, total = comm.allreduce(counts.numpy())
        top1 = correct / total
        if comm.Get_rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.3f} val top-1 {100 * top1:.1f}%", flush=True)
    if args.json and comm.Get_rank() == 0:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("examples/own_loop.py", vars(args), {
            "val_top1": top1, "images_per_s": images / seconds, "world_size": comm.Get_size()}))


if __name__ == "__main__":
    main()
