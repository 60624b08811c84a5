"""Benchmark loaders on tiny fake trees of every supported layout (a few generated JPEGs)."""

import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from pml_hyperbolic.data import (
    Cars196Dataset,
    CUB200Dataset,
    DatasetNotFoundError,
    InShopDataset,
    OnlineProductsDataset,
    build_dataset,
    build_transforms,
    collate_skipping_unreadable,
    find_dataset_root,
)

MODES = ("RGB", "L", "CMYK")  # the benchmarks contain greyscale and CMYK JPEGs


def write_jpeg(path, seed):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8))
    mode = MODES[seed % len(MODES)]
    if mode != "RGB":
        image = image.convert(mode)
    image.save(path, format="JPEG")


def make_cars_stanford(root, classes=(1, 2, 98, 99, 100, 196), per_class=2):
    from scipy.io import savemat

    records, counter = [], 0
    for class_id in classes:
        for _ in range(per_class):
            counter += 1
            relative = f"car_ims/{counter:06d}.jpg"
            write_jpeg(os.path.join(root, relative), counter)
            records.append((relative, 1, 2, 10, 11, class_id, counter % 2))
    dtype = [("relative_im_path", "O"), ("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"),
             ("bbox_y2", "O"), ("class", "O"), ("test", "O")]
    annotations = np.array([records], dtype=dtype)  # (1, N) struct array as in the original file
    class_names = np.array([f"Make Model {i}" for i in range(1, 197)], dtype=object)
    savemat(os.path.join(root, "cars_annos.mat"), {"annotations": annotations, "class_names": class_names})
    return len(records)


def make_cars_pml(root, classes=(1, 50, 98, 99, 150, 196)):
    names = [f"Make Model/{i}" for i in range(1, 197)]
    with open(os.path.join(root, "names.csv"), "w") as f:
        f.write("\n".join(names) + "\n")
    counter = 0
    for split in ("train", "test"):
        lines = []
        for class_id in classes:
            counter += 1
            filename = f"{counter:05d}.jpg"
            folder = names[class_id - 1].replace("/", "-")
            write_jpeg(os.path.join(root, "car_data", "car_data", split, folder, filename), counter)
            lines.append(f"{filename},1,2,10,11,{class_id}")
        with open(os.path.join(root, f"anno_{split}.csv"), "w") as f:
            f.write("\n".join(lines) + "\n")


def make_cub(base, classes=(1, 2, 100, 101, 200)):
    images, labels = [], []
    image_id = 0
    for class_id in classes:
        for k in range(2):
            image_id += 1
            relative = f"{class_id:03d}.Bird_{class_id}/bird_{k}.jpg"
            write_jpeg(os.path.join(base, "images", relative), image_id)
            images.append(f"{image_id} {relative}")
            labels.append(f"{image_id} {class_id}")
    with open(os.path.join(base, "images.txt"), "w") as f:
        f.write("\n".join(images) + "\n")
    with open(os.path.join(base, "image_class_labels.txt"), "w") as f:
        f.write("\n".join(labels) + "\n")


def make_sop(base):
    rows = {"train": [(11, 1, "bicycle"), (11, 1, "bicycle"), (12, 3, "chair"), (17, 3, "chair")],
            "test": [(20001, 2, "cabinet"), (20001, 2, "cabinet"), (20002, 5, "kettle")]}
    image_id = 0
    for split, entries in rows.items():
        lines = ["image_id class_id super_class_id path"]
        for class_id, super_id, category in entries:
            image_id += 1
            relative = f"{category}_final/{class_id}_{image_id}.JPG"
            write_jpeg(os.path.join(base, relative), image_id)
            lines.append(f"{image_id} {class_id} {super_id} {relative}")
        with open(os.path.join(base, f"Ebay_{split}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def make_inshop(root, official=False):
    entries = [
        ("WOMEN/Dresses", "id_00000001", "train"), ("WOMEN/Dresses", "id_00000001", "train"),
        ("MEN/Denim", "id_00000003", "train"),
        ("WOMEN/Dresses", "id_00000002", "query"), ("WOMEN/Dresses", "id_00000002", "gallery"),
        ("MEN/Shirts_Polos", "id_00000007", "query"), ("MEN/Shirts_Polos", "id_00000007", "gallery"),
        ("MEN/Denim", "id_00000009", "gallery"),
    ]
    image_base = os.path.join(root, "Img") if official else root
    eval_dir = os.path.join(root, "Eval") if official else root
    os.makedirs(eval_dir, exist_ok=True)
    lines = [str(len(entries)), "image_name item_id evaluation_status"]
    for k, (category, item, status) in enumerate(entries):
        relative = f"img/{category}/{item}/{k:02d}_1_front.jpg"
        write_jpeg(os.path.join(image_base, relative), k)
        lines.append(f"{relative}    {item} {status}")
    with open(os.path.join(eval_dir, "list_eval_partition.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def assert_rgb_and_remapped(dataset):
    assert dataset.labels.dtype == np.int64
    assert set(dataset.labels.tolist()) == set(range(dataset.num_classes))
    for index in range(len(dataset)):
        image, label = dataset[index]
        assert image.mode == "RGB"
        assert label == dataset.labels[index]


def test_cars_stanford_layout_split_and_remap(tmp_path):
    make_cars_stanford(str(tmp_path))
    assert Cars196Dataset.detect_layout(str(tmp_path)) == "stanford"
    train = Cars196Dataset(str(tmp_path), "train")
    test = Cars196Dataset(str(tmp_path), "test")
    assert sorted(set(train.raw_labels.tolist())) == [1, 2, 98]
    assert sorted(set(test.raw_labels.tolist())) == [99, 100, 196]
    assert len(train) == 6 and len(test) == 6 and train.num_classes == 3
    assert_rgb_and_remapped(train)
    assert_rgb_and_remapped(test)
    assert train.super_labels is None


def test_cars_pml_layout_via_pml_loader(tmp_path):
    make_cars_pml(str(tmp_path))
    assert Cars196Dataset.detect_layout(str(tmp_path)) == "pml"
    train = Cars196Dataset(str(tmp_path), "train")
    test = Cars196Dataset(str(tmp_path), "test")
    # both PML csv files contribute; first 98 classes train
    assert sorted(set(train.raw_labels.tolist())) == [1, 50, 98] and len(train) == 6
    assert sorted(set(test.raw_labels.tolist())) == [99, 150, 196] and len(test) == 6
    assert_rgb_and_remapped(train)


@pytest.mark.parametrize("nested", [True, False])
def test_cub_layouts(tmp_path, nested):
    base = tmp_path / ("CUB_200_2011" if nested else "my_cub_copy")
    make_cub(str(base))
    root = str(tmp_path) if nested else str(base)
    train = CUB200Dataset(root, "train")
    test = CUB200Dataset(root, "test")
    assert sorted(set(train.raw_labels.tolist())) == [1, 2, 100]
    assert sorted(set(test.raw_labels.tolist())) == [101, 200]
    assert_rgb_and_remapped(train)
    assert_rgb_and_remapped(test)


@pytest.mark.parametrize("nested", [True, False])
def test_sop_official_split_and_super_labels(tmp_path, nested):
    base = tmp_path / "Stanford_Online_Products" if nested else tmp_path
    make_sop(str(base))
    train = OnlineProductsDataset(str(tmp_path), "train")
    test = OnlineProductsDataset(str(tmp_path), "test")
    assert train.num_classes == 3 and test.num_classes == 2
    assert train.labels.tolist() == [0, 0, 1, 2]
    assert train.super_labels.tolist() == [0, 0, 1, 1]  # super_class_id 1, 3 remapped
    assert train.hierarchical_labels.shape == (4, 2)
    assert np.array_equal(train.hierarchical_labels[:, 0], train.labels)
    assert_rgb_and_remapped(test)


@pytest.mark.parametrize("official", [False, True])
def test_inshop_partition_query_gallery_share_labels(tmp_path, official):
    make_inshop(str(tmp_path), official=official)
    assert InShopDataset.detect_layout(str(tmp_path)) == ("official" if official else "flat")
    train = InShopDataset(str(tmp_path), "train")
    query = InShopDataset(str(tmp_path), "query")
    gallery = InShopDataset(str(tmp_path), "gallery")
    test = InShopDataset(str(tmp_path), "test")
    assert len(train) == 3 and train.num_classes == 2
    assert len(query) == 2 and len(gallery) == 3 and len(test) == 5
    # query and gallery share the test label space: item id 2 -> 0, 7 -> 1, 9 -> 2
    assert query.num_classes == gallery.num_classes == 3
    assert query.labels.tolist() == [0, 1] and gallery.labels.tolist() == [0, 1, 2]
    assert list(query.raw_labels) == ["id_00000002", "id_00000007"]
    # category path super-labels, in one space for query and gallery
    assert list(gallery.super_class_ids) == ["MEN/Denim", "MEN/Shirts_Polos", "WOMEN/Dresses"]
    assert query.super_labels.tolist() == [2, 1]
    assert gallery.hierarchical_labels.tolist() == [[0, 2], [1, 1], [2, 0]]
    assert_rgb_and_remapped(gallery)


@pytest.mark.parametrize("name", ["cars196", "cub200", "sop", "inshop"])
def test_missing_folder_error_names_layout_and_source(tmp_path, name, monkeypatch):
    for variable in ("PML_HYPERBOLIC_DATA", "PML_HYPERBOLIC_CARS196", "PML_HYPERBOLIC_CUB200",
                     "PML_HYPERBOLIC_SOP", "PML_HYPERBOLIC_INSHOP"):
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "junk.txt").write_text("not a dataset")
    for root in (str(tmp_path / "does_not_exist"), str(tmp_path), None):
        with pytest.raises(DatasetNotFoundError) as info:
            build_dataset(name, "train", root=root)
        message = str(info.value)
        assert "Expected one of" in message and "Get the data from" in message and "http" in message
        assert isinstance(info.value, FileNotFoundError)


def test_malformed_files_give_the_same_clear_error(tmp_path):
    sop = tmp_path / "sop"
    make_sop(str(sop))
    (sop / "Ebay_train.txt").write_text("garbage header\n1 2 3 x.jpg\n")
    with pytest.raises(DatasetNotFoundError, match="image_id class_id super_class_id path"):
        OnlineProductsDataset(str(sop), "train")
    cars = tmp_path / "cars"
    (cars / "car_ims").mkdir(parents=True)
    (cars / "cars_annos.mat").write_bytes(b"this is not a mat file")
    with pytest.raises(DatasetNotFoundError, match="cars_annos.mat"):
        Cars196Dataset(str(cars), "train")
    inshop = tmp_path / "inshop"
    make_inshop(str(inshop))
    (inshop / "list_eval_partition.txt").write_text("3\nwrong header\n")
    with pytest.raises(DatasetNotFoundError, match="image_name item_id evaluation_status"):
        InShopDataset(str(inshop), "train")
    (inshop / "list_eval_partition.txt").write_text("0\nimage_name item_id evaluation_status\n")
    with pytest.raises(DatasetNotFoundError, match="no images listed for split 'train'"):
        InShopDataset(str(inshop), "train")
    # CUB list files with garbage, in both the nested (PML's reader) and flat layouts
    for nested in (True, False):
        cub = tmp_path / ("cub_nested" if nested else "cub_flat")
        base = cub / "CUB_200_2011" if nested else cub
        base.mkdir(parents=True)
        make_cub(str(base))
        (base / "image_class_labels.txt").write_text("1 2 3 4\nnot numbers\n")
        with pytest.raises(DatasetNotFoundError, match="malformed"):
            CUB200Dataset(str(cub), "train")
    # Cars in the Kaggle (PML) layout with a broken annotation CSV
    kaggle = tmp_path / "cars_kaggle"
    kaggle.mkdir()
    make_cars_pml(str(kaggle))
    (kaggle / "anno_train.csv").write_text("00001.jpg,1,2,10,11,not-a-class\n")
    with pytest.raises(DatasetNotFoundError, match="malformed"):
        Cars196Dataset(str(kaggle), "train")
    # SOP with a non-numeric class id
    sop_bad = tmp_path / "sop_bad"
    make_sop(str(sop_bad))
    (sop_bad / "Ebay_train.txt").write_text("image_id class_id super_class_id path\n1 x 1 a_final/1.JPG\n")
    with pytest.raises(DatasetNotFoundError, match="line 2"):
        OnlineProductsDataset(str(sop_bad), "train")


def break_image(path):
    with open(path, "wb") as f:
        f.write(b"\xff\xd8 not really a jpeg")


def test_unreadable_image_is_skipped_with_warning_and_counted(tmp_path):
    make_sop(str(tmp_path))
    dataset = OnlineProductsDataset(str(tmp_path), "train", transform=build_transforms(
        "imagenet", train=False, image_size=32, resize_size=36))
    break_image(dataset.paths[0])
    with pytest.warns(RuntimeWarning, match="unreadable image .* skipped"):
        assert dataset[0] is None
    assert dataset.num_unreadable == 1 and dataset.unreadable_paths == [dataset.paths[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once only
        assert dataset[0] is None
    assert dataset.num_unreadable == 1
    images, labels = collate_skipping_unreadable([dataset[i] for i in range(len(dataset))])
    assert images.shape[0] == 3 and labels.tolist() == dataset.labels[1:].tolist()
    with pytest.warns(RuntimeWarning, match="all 1 images of a batch were unreadable"):
        assert collate_skipping_unreadable([dataset[0]]) is None  # skipped by the trainer / tester

    fresh = OnlineProductsDataset(str(tmp_path), "train")
    with pytest.warns(RuntimeWarning):
        assert fresh.check_images() == 1
    assert len(fresh) == 3 and fresh.num_classes == 3 and fresh.num_unreadable == 1
    assert fresh.labels.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="on_unreadable"):
        OnlineProductsDataset(str(tmp_path), "train", on_unreadable="ignore")


def test_unreadable_image_substitute_mode(tmp_path):
    make_sop(str(tmp_path))
    dataset = OnlineProductsDataset(str(tmp_path), "train", on_unreadable="substitute")
    break_image(dataset.paths[0])
    with pytest.warns(RuntimeWarning, match="replaced by another image of the same class"):
        image, label = dataset[0]
    assert image.mode == "RGB" and label == dataset.labels[0]
    assert dataset.num_unreadable == 1


def test_unreadable_count_is_shared_with_dataloader_workers(tmp_path):
    # workers are other processes, re-created every epoch: the count must reach the parent and a
    # file must be counted once, however many workers and epochs meet it
    make_sop(str(tmp_path))
    dataset = OnlineProductsDataset(str(tmp_path), "train", transform=build_transforms("imagenet", train=False,
                                                                                        image_size=32, resize_size=36))
    break_image(dataset.paths[1])
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2,
                                         collate_fn=collate_skipping_unreadable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            sizes = [len(labels) for _, labels in loader]
            assert sorted(sizes) == [1, 2]
    assert dataset.num_unreadable == 1
    import copy
    import pickle

    for clone in (copy.deepcopy(dataset), pickle.loads(pickle.dumps(dataset))):
        assert clone.num_unreadable == 1 and clone[1] is None


def test_tester_and_index_aligned_embeddings_skip_unreadable_images(tmp_path):
    from pml_hyperbolic.training.evaluation import build_tester
    from pml_hyperbolic.training.runner import compute_embeddings

    make_sop(str(tmp_path))
    dataset = OnlineProductsDataset(str(tmp_path), "train", transform=build_transforms(
        "imagenet", train=False, image_size=32, resize_size=36))
    break_image(dataset.paths[2])
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Hardtanh(-0.5, 0.5))
    tester = build_tester(c=1.0, k_values=(1,), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        emb, labels = tester.get_all_embeddings(dataset, trunk, head,
                                                collate_fn=collate_skipping_unreadable)
        # PML's own pass would return 4 rows, the last a zero row labelled 0
        assert emb.shape == (3, 3) and labels[:, 0].tolist() == [0, 0, 2]
        aligned = compute_embeddings(trunk, head, dataset, "cpu", batch_size=2)
    assert aligned.shape == (4, 3)
    assert torch.equal(aligned[2], torch.zeros(3))  # the unreadable row stays at the origin
    torch.testing.assert_close(aligned[[0, 1, 3]], emb)


def test_find_dataset_root_uses_env_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("PML_HYPERBOLIC_CARS196", raising=False)
    monkeypatch.delenv("PML_HYPERBOLIC_DATA", raising=False)
    assert find_dataset_root("cars196") is None
    cars = tmp_path / "cars196"
    cars.mkdir()
    make_cars_stanford(str(cars), classes=(1, 99), per_class=1)
    assert find_dataset_root("cars196", str(cars)) == str(cars)
    monkeypatch.setenv("PML_HYPERBOLIC_DATA", str(tmp_path))
    assert find_dataset_root("cars196") == str(cars)
    monkeypatch.setenv("PML_HYPERBOLIC_CARS196", str(cars))
    dataset = build_dataset("cars196", "test", transform=build_transforms("imagenet", train=False))
    image, label = dataset[0]
    assert image.shape == (3, 224, 224) and image.dtype == torch.float32 and label == 0
    assert find_dataset_root("glyphs") is not None  # the bundled set is always found


def test_build_dataset_rejects_unknown_names_and_splits():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="splits"):
        build_dataset("cars196", "query")


def test_recipe_counts_each_unreadable_file_once_across_its_datasets(tmp_path):
    # the runner's end-of-run report: two views of the training set (same files), a pseudo-label
    # wrapper, a subset and the test split; a file met in two views is one unreadable file
    from types import SimpleNamespace

    from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset
    from pml_hyperbolic.training.runner import LabelledSubset, Recipe

    make_sop(str(tmp_path))
    train_a = OnlineProductsDataset(str(tmp_path), "train")
    train_b = OnlineProductsDataset(str(tmp_path), "train")
    test = OnlineProductsDataset(str(tmp_path), "test")
    break_image(train_a.paths[0])
    break_image(test.paths[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ds in (train_a, train_b, test):
            [ds[i] for i in range(len(ds))]
    fake = SimpleNamespace(train_set=PseudoLabelledDataset(LabelledSubset(train_a, [0, 1, 2])),
                           train_eval_set=train_b, eval_sets={"test": torch.utils.data.Subset(test, [0, 1])})
    assert Recipe.count_unreadable(fake) == 2


def test_trainer_and_tester_skip_a_batch_of_unreadable_images_only(tmp_path):
    # a whole batch unreadable is not a crash mid-epoch: the trainer takes the next batch, the tester
    # leaves it out
    from pml_hyperbolic.training.evaluation import build_tester
    from pml_hyperbolic.training.trainer import HyperbolicTrainer
    from pytorch_metric_learning.losses import ContrastiveLoss

    make_sop(str(tmp_path))
    tf = build_transforms("imagenet", train=False, image_size=32, resize_size=36)
    dataset = OnlineProductsDataset(str(tmp_path), "train", transform=tf)
    for i in (0, 1):  # class 11 (both images of the first batch below) unreadable
        break_image(dataset.paths[i])
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    head = torch.nn.Linear(4, 3)
    # a fixed batch sampler: the first batch is all unreadable
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(4)), 2, drop_last=True)
    trainer = HyperbolicTrainer(
        models={"trunk": trunk, "embedder": head},
        optimizers={"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.1)},
        batch_size=2, loss_funcs={"metric_loss": ContrastiveLoss()}, mining_funcs={}, dataset=dataset,
        sampler=batches, iterations_per_epoch=1, collate_fn=collate_skipping_unreadable,
        dataloader_num_workers=0, end_of_epoch_hook=lambda t: True, show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(1, 1)
        assert trainer.global_step == 1  # one step, on the readable batch
        tester = build_tester(c=None, k_values=(1,), batch_size=2)
        emb, labels = tester.get_all_embeddings(dataset, trunk, head, collate_fn=collate_skipping_unreadable)
    assert emb.shape == (2, 3) and labels[:, 0].tolist() == [1, 2]
