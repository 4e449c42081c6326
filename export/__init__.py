"""softq.export"""
